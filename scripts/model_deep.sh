#!/usr/bin/env bash
# The model check at deeper bounds than `cargo test` explores, for a release
# (docs/reliability.md, "What is proven"): each mode (external with the point of no return at
# reservation, external with it separate, local) explored exhaustively, every property held.
# No network, no database; it prints each configuration's state count and time.
#
#   scripts/model_deep.sh
#
# MODEL_CLIENTS (the body each client sends with the key: A the operation, B another request;
# default AAB), MODEL_ATTEMPTS per client (3; `cargo test` makes 2), MODEL_CRASHES (1) and
# MODEL_LOSSES (1: lost requests, answers and commit answers) set the bounds. At the defaults:
# 18 and 33 million states, 6 minutes on 2 cores, under 6 GiB. Each step up multiplies the
# states and the memory.
set -euo pipefail
cd "$(dirname "$0")/.."
export MODEL_CLIENTS=${MODEL_CLIENTS:-AAB}
export MODEL_ATTEMPTS=${MODEL_ATTEMPTS:-3}
export MODEL_CRASHES=${MODEL_CRASHES:-1}
export MODEL_LOSSES=${MODEL_LOSSES:-1}
echo "clients $MODEL_CLIENTS, $MODEL_ATTEMPTS attempts each, $MODEL_CRASHES crashes, $MODEL_LOSSES losses"
cargo test --release -q -p idemkey-model --test model deep -- --ignored --nocapture
