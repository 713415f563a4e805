#!/usr/bin/env bash
# On the H200: reassembles the verl payload (bench/build_verl_payload.sh) into /tmp/verl_site. Each call that
# carries a part runs this script; the call that has the last part unpacks (all earlier parts must be in
# /tmp/verl_parts by then: the calls go back to back on one warm machine). Nothing is exported: bench_e2e.py
# puts /tmp/verl_site on the PYTHONPATH of the verl subprocess only, ahead of the vLLM payload's /tmp/site.
#   call k of n:  bash bench/verl_device_install.sh
# Run it after the vLLM payload's device_install.sh, so that the check below sees vLLM and its packages.
set -uo pipefail
site=/tmp/verl_site parts=/tmp/verl_parts
mkdir -p "$parts"
for d in .gpu_verl[0-9]*; do [ -d "$d" ] && cp "$d"/* "$parts"/; done
if [ -f "$site/verl/__init__.py" ]; then
  echo "verl payload already in $site"
elif [ ! -f "$parts/nparts" ]; then
  echo "verl payload: $(ls "$parts" | tr '\n' ' ')kept in $parts; the call with the last part unpacks"
  exit 0
else
  n=$(cat "$parts/nparts")
  for i in $(seq 1 "$n"); do
    [ -f "$parts/verl.part$i" ] || { echo "missing $parts/verl.part$i: the machine was not kept warm; send the parts again" >&2; exit 3; }
  done
  got=$(for i in $(seq 1 "$n"); do cat "$parts/verl.part$i"; done | sha256sum | cut -c1-16)
  [ "$got" = "$(cat "$parts/sha256")" ] || { echo "verl payload checksum $got != $(cat "$parts/sha256")" >&2; exit 4; }
  rm -rf /tmp/verl_stage && mkdir -p /tmp/verl_stage
  for i in $(seq 1 "$n"); do cat "$parts/verl.part$i"; done | xz -d -T0 | tar -x -C /tmp/verl_stage
  mv /tmp/verl_stage/site "$site"
  # The wheels go in only where the device (with the vLLM payload) has no version that satisfies the
  # requirements of what is in $site, of the roots (what vLLM's server path imports) and of the wheels so chosen.
  PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} python3 - "$site" /tmp/verl_stage/wheels /tmp/verl_stage/roots <<'EOF' > /tmp/verl_stage/chosen
import importlib.metadata as md, pathlib, sys, zipfile
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name as canon
site, wheels = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
have = {}
for d in md.distributions():  # sys.path order: the first of a name is the one imported
    have.setdefault(canon(d.metadata["Name"]), d.version)
def needs(text):
    for line in text.splitlines():
        if line.startswith("Requires-Dist:"):
            r = Requirement(line.split(":", 1)[1].strip())
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                yield r
carried = {canon(w.name.split("-")[0]): w for w in wheels.glob("*.whl")}
todo = [r for m in site.glob("*.dist-info/METADATA") for r in needs(m.read_text())]
todo += [Requirement(line) for line in pathlib.Path(sys.argv[3]).read_text().splitlines() if line]
chosen, missing = set(), set()
while todo:
    r = todo.pop()
    name = canon(r.name)
    if name in chosen or (name in have and r.specifier.contains(have[name], prereleases=True)):
        continue
    if name in carried:
        chosen.add(name)
        with zipfile.ZipFile(carried[name]) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            todo += needs(z.read(meta).decode())
    else:
        missing.add(f"{r} (found {have.get(name)})")
for name in sorted(chosen):
    print(carried[name])
for m in sorted(missing):
    print(f"not satisfied and not carried: {m}", file=sys.stderr)
EOF
  echo "installing $(wc -l < /tmp/verl_stage/chosen) wheels the device lacks: $(xargs -n1 basename < /tmp/verl_stage/chosen | tr '\n' ' ')"
  [ -s /tmp/verl_stage/chosen ] && xargs python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" < /tmp/verl_stage/chosen
fi
# The modules of verl's GRPO path, imported as the verl subprocess will see them.
PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} python3 -c "
import importlib.metadata as md
import hydra, ray, tensordict, torchdata, transfer_queue, transformers, verl, vllm
import verl.trainer.main_ppo, verl.trainer.ppo.v1, verl.workers.engine_workers
import verl.workers.rollout.vllm_rollout.vllm_async_server
print('verl', verl.__version__, 'ray', ray.__version__, 'transformers', transformers.__version__,
      'tensordict', md.version('tensordict'), 'vllm', vllm.__version__, 'ready in $site')
"
