#!/bin/bash
# Wall time and peak RSS of the main commands on the zoo, one command at a time, each in a fresh process,
# measured with GNU time (/usr/bin/time -v). Run from the repository root after `make setup`:
#   analysis/timing/measure.sh > analysis/timing/timings.txt
# The README's time-and-memory table quotes timings.txt.
set -u
export OMP_WAIT_POLICY=PASSIVE DIFFQUANT_QUIET=1
DQ=${DQ:-$PWD/.venv/bin/diffquant}
work=$(mktemp -d)
cd "$work" || exit 1
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(free -g | awk '/Mem:/ {print $2}') GiB"
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
m() {
  name=$1
  shift
  /usr/bin/time -v "$@" >"$name.out" 2>"$name.err"
  rc=$?
  wall=$(sed -n 's/.*Elapsed (wall clock) time (h:mm:ss or m:ss): //p' "$name.err")
  rss=$(sed -n 's/.*Maximum resident set size (kbytes): //p' "$name.err")
  cpu=$(sed -n 's/.*Percent of CPU this job got: //p' "$name.err")
  printf '%-9s rc=%s wall %s  peak RSS %s MiB  CPU %s  : %s\n' "$name" "$rc" "$wall" "$((rss / 1024))" "$cpu" "diffquant ${*:2}"
}
m zoo "$DQ" zoo
m info "$DQ" info zoo:diff_v2
m profile "$DQ" profile zoo:baseline zoo:diff_v1 zoo:diff_v2 --tokens 8192 --seq-len 256 --out runs/prof
m quantize "$DQ" quantize zoo:diff_v2 --plan w8a8-tensor --out runs/q
m eval "$DQ" eval zoo:diff_v2 --task bpb:tokens=8192 --plan w8a8 w4a8 --out runs/eval
m demo "$DQ" demo --out runs/demo
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
rm -rf "$work"
