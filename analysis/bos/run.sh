#!/usr/bin/env bash
# The BOS convention's effect on a real model's perplexity (issue 47): Gemma-3-270M (fetched at run time) on the
# first 4 x 1,024 tokens of WikiText-2 test, disjoint windows, under each `bos` convention. Writes
# analysis/bos/gemma3/ (the eval's results) and prints them; docs/results.md quotes this run.
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_WAIT_POLICY=PASSIVE
task="ppl:data=wikitext2:test,tokens=4096,seq_len=1024,windows=disjoint"
diffquant eval fetch:gemma3-270m --task "$task,bos=stream,name=bos-stream" --task "$task,bos=window,name=bos-window" \
  --task "$task,bos=none,name=bos-none" --batch-size 1 --out analysis/bos/gemma3 --force "$@"
