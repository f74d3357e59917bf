#!/usr/bin/env bash
# The tiny 2x2 runs that show a change of the trainer is bit-identical: run them with the code of two
# checkouts, then compare every tensor of their final checkpoints:
#
#   scripts/equivalence_runs.sh OLD_CHECKOUT /tmp/equiv/old
#   scripts/equivalence_runs.sh .            /tmp/equiv/new
#   dipaco compare --experiments /tmp/equiv/old/run /tmp/equiv/new/run \
#       one tr2_int8 tr4_bf16 stream2 stream_blocks stream_tr3_fp4 delayed delayed_eager_tr2 delayed2 \
#       kmeans_extras em validated resumed
#
# Each run is a few seconds to a minute on 2 CPU cores (one torch thread each); the torchrun runs use
# gloo on loopback. ray_rounds (ray.schedule=rounds) is not bit-reproducible: arrivals change the
# order of fp32 sums; compare its bank with the lock-step `one` instead.
set -euo pipefail
REPO=$(cd "$1" && pwd); OUT=$2
HERE=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$HERE/.venv/bin/python}
TORCHRUN=${TORCHRUN:-$(dirname "$PY")/torchrun}
export PYTHONPATH=$REPO OMP_NUM_THREADS=1
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
cd "$REPO"
TINY="model.num_layers=2 model.hidden_size=32 model.intermediate_size=64 model.num_heads=2 data.seq_len=64
 data.prefix_tokens=16 tokenizer.vocab_size=512 topology.preset=grid:2x2 pretrain.steps=30 pretrain.optim.batch_size=8
 pretrain.optim.warmup_steps=5 train.optim.batch_size=8 train.optim.warmup_steps=5 train.rounds=3 train.inner_steps=6
 run.progress=false run.device=cpu eval.batch_size=32 run.dir=$OUT/run data.corpus=$OUT/corpus.jsonl
 route.featurizer=tfidf_svd route.svd_components=16 route.n_init=1"
dip() { "$PY" -m dipaco "$@"; }
if [ ! -f "$OUT/run/pretrain/config.json" ]; then
  "$PY" -c "import sys; sys.path.insert(0, 'tests/dipaco'); from tiny import write_corpus_slice; from pathlib import Path; write_corpus_slice(Path('$OUT/corpus.jsonl'))"
  dip prepare $TINY; dip pretrain $TINY; dip route $TINY
fi
run() { name=$1; shift; [ -d "$OUT/run/train/$name/checkpoints" ] && return 0; echo "== $name"; "$@" 2>&1 | tail -1; }
tr() { "$TORCHRUN" --standalone --nproc-per-node "$1" -m dipaco train $TINY train.name="$2" "${@:3}"; }
run one      dip train $TINY train.name=one
run tr2_int8 tr 2 tr2_int8 dist.comm_dtype=int8
run tr4_bf16 tr 4 tr4_bf16 dist.comm_dtype=bf16
run stream2  dip train $TINY train.name=stream2 outer.sync=streaming outer.streaming.num_fragments=2
run stream_blocks dip train $TINY train.name=stream_blocks outer.sync=streaming outer.streaming.fragment=blocks:1 \
    outer.streaming.num_fragments=3 outer.streaming.overlap_steps=1 outer.streaming.mix_alpha=0.5
run stream_tr3_fp4 tr 3 stream_tr3_fp4 outer.sync=streaming outer.streaming.num_fragments=2 outer.streaming.overlap_steps=2 \
    dist.comm_dtype=fp4 dist.adaptive=true
run delayed  dip train $TINY train.name=delayed outer.sync=delayed
run delayed_eager_tr2 tr 2 delayed_eager_tr2 outer.sync=delayed outer.delayed.eager=true dist.comm_dtype=int8
run delayed2 dip train $TINY train.name=delayed2 outer.sync=delayed outer.delayed.delay=2
run kmeans_extras dip train $TINY train.name=kmeans_extras train.sharding=kmeans outer.rescale=sqrt_paths \
    outer.embedding_head_lr_scale=1.5 outer.drop_prob=0.3 train.early_stopping_holdout=0.1
run em       dip train $TINY train.name=em train.sharding=kmeans route.em_rounds=[1]
run validated dip train $TINY train.name=validated eval.every=1 eval.max_docs=16 train.early_stopping_holdout=0.1
if [ ! -d "$OUT/run/train/resumed/checkpoints" ]; then
  echo "== resumed"; dip train $TINY train.name=resumed --until-round 1 2>&1 | tail -1
  dip train $TINY train.name=resumed --resume 2>&1 | tail -1
fi
run ray_rounds dip train $TINY train.name=ray_rounds train.driver=ray outer.sync=async_nesterov ray.schedule=rounds ray.num_cpus=2
