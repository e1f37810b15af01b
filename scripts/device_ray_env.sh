#!/usr/bin/env bash
# Source on a GPU host that has no Ray and no network (the lent H200), from the repo root: installs the offline
# Ray bundle (.raybundle/, built on a networked machine with scripts/offline_ray_bundle.sh) into /tmp/site once
# and puts it and the source tree on PYTHONPATH. Ray's own workers inherit the environment.
SITE=${RAY_SITE:-/tmp/site}
if [ ! -d "$SITE/ray" ] && [ -d .raybundle ]; then
  python3 -m pip install -q --no-index --no-deps --target "$SITE" .raybundle/*.whl >/dev/null 2>&1
  python3 -m zipfile -e .raybundle/ray-core.zip "$SITE"
  chmod +x "$SITE"/ray/core/src/ray/gcs/gcs_server "$SITE"/ray/core/src/ray/raylet/raylet
fi
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
