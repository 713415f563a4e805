#!/usr/bin/env bash
# The workplace's vLLM payload (../shared/gpu/build_payload.sh: .gpu1-3, three device calls) re-cut into two
# halves, .gpuA and .gpuB (about 54 MiB each: one call carries 64 MiB with the tree), so vLLM is ready one
# call sooner and the second call also runs work. Same bytes: `xz -t` checks the joined halves here.
#   call 1 (carry .gpuA):           mkdir -p /tmp/parts && cp .gpuA/site.a /tmp/parts/
#   call 2 (carry .gpuB .gpu_trl):  source .gpuB/install2.sh && FLATRL_COMMIT=<sha> bash bench/run_h200.sh defaults
# Used on 2026-12-05 (the defaults part ran in call 2).
set -euo pipefail
cd "$(dirname "$0")/.."
for i in 1 2 3; do [ -f .gpu$i/site.part$i ] || { echo "no .gpu$i/site.part$i: run bash ../shared/gpu/build_payload.sh first" >&2; exit 2; }; done
for d in .gpuA .gpuB; do grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude; done
rm -rf .gpuA .gpuB && mkdir -p .gpuA .gpuB
total=$(cat .gpu1/site.part1 .gpu2/site.part2 .gpu3/site.part3 | wc -c)
cat .gpu1/site.part1 .gpu2/site.part2 .gpu3/site.part3 | split -b $(( (total + 1) / 2 )) - .gpuA/half.
mv .gpuA/half.aa .gpuA/site.a && mv .gpuA/half.ab .gpuB/site.b
cat .gpuA/site.a .gpuB/site.b | xz -t -T0 -
cat > .gpuB/install2.sh <<'SH'
#!/usr/bin/env bash
# On the device, in the second call (bench/split_payload.sh): joins the halves into /tmp/site once, sets vLLM's env.
mkdir -p /tmp/parts && cp .gpuB/site.b /tmp/parts/ 2>/dev/null
if [ ! -f /tmp/site/vllm/__init__.py ]; then
  [ -f /tmp/parts/site.a ] || { echo "missing /tmp/parts/site.a: the machine went back; send .gpuA again" >&2; return 3 2>/dev/null || exit 3; }
  mkdir -p /tmp/site && cat /tmp/parts/site.a /tmp/parts/site.b | xz -d -T0 | tar -x -C /tmp/site
fi
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 PYTHONUNBUFFERED=1
python3 -c "import vllm; print('vllm', vllm.__version__, 'ready')"
SH
du -sh .gpuA .gpuB
