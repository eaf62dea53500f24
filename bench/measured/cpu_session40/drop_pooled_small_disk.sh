#!/usr/bin/env bash
# Session 40, issue 52: --drop-pooled on a real small disk (a 45 MiB tmpfs), this 2-core CPU.
# shape:smoke (random weights, d 64, 4 heads of 16, 2 layers), the full corpus's first 8 concepts (2,000 passages
# each), S3 alone (its per-head vectors: the bulk of an 8B run's store), --max-length 512, no steering.
set -u
D=/work/main/.venv/bin/poolbench-driver
C=academic_tone,bureaucratic,causation,code_docs,conditionality,contrast,deference,depression
ARGS="--model shape:smoke --corpus-size full --concepts $C --layers 0,1 --strategies S3_iti_probe --max-length 512 --no-steering"
OUT=${OUT:-/tmp/s40/demo}
mkdir -p $OUT
df -B1 /mnt/small | tail -1
echo "== keep (the default), the small disk"; $D run $ARGS --store /mnt/small/keep --out $OUT/keep_small; echo "rc=$?" | tee $OUT/keep_small_rc
echo "== --drop-pooled, the small disk"
rm -f $OUT/done $OUT/peak
( peak=0; while [ ! -f $OUT/done ]; do u=$(du -sb /mnt/small 2>/dev/null | cut -f1); [ "${u:-0}" -gt "$peak" ] && peak=$u && echo "$peak" > $OUT/peak; sleep 0.1; done ) &
start=$(date +%s); $D run $ARGS --drop-pooled --store /mnt/small/drop --out $OUT/drop_small; rc=$?; echo "$rc $(( $(date +%s)-start ))" > $OUT/drop_rc_s; echo "rc=$rc $(( $(date +%s)-start ))s"
touch $OUT/done; wait
echo "most bytes on the small disk during the run (du every 0.1 s): $(cat $OUT/peak)"
echo "after it:"; du -sb /mnt/small/drop/* | sort -n
echo "== keep, a large disk"; start=$(date +%s); $D run $ARGS --store $OUT/keep_store --out $OUT/keep_big; rc=$?; echo "$rc $(( $(date +%s)-start ))" > $OUT/keep_rc_s; echo "rc=$rc $(( $(date +%s)-start ))s"
du -sb /mnt/small/drop/* > $OUT/drop_after; du -sb $OUT/keep_store/* > $OUT/keep_after
du -sb $OUT/keep_store/* | sort -n
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
a, b = (json.load(open(f"{out}/{r}/results.json")) for r in ("drop_small", "keep_big"))
print("D1 records equal (drop on the small disk, keep on the large one):", a["cells"] == b["cells"], len(a["cells"]))
print("computed:", a["computed"], b["computed"])
def kinds(path):
    return {line.split()[1].rsplit("/", 1)[1]: int(line.split()[0]) for line in open(path)}
drop_rc, drop_s = (int(v) for v in open(f"{out}/drop_rc_s").read().split())
keep_rc, keep_s = (int(v) for v in open(f"{out}/keep_rc_s").read().split())
summary = {"benchmark": "drop_pooled_small_disk", "date": a["date"], "git_hash": a["git_hash"],
           "machine": "this 2-core CPU", "store_disk": "tmpfs, 45 MiB (47,185,920 bytes)",
           "config": {k: a["config"][k] for k in ("model", "corpus_size", "concepts", "layers", "strategies",
                                                  "max_length", "steering", "drop_pooled")},
           "keep_on_small_disk": {"rc": int(open(f"{out}/keep_small_rc").read().split("=")[1])},
           "drop_on_small_disk": {"rc": drop_rc, "wall_s": drop_s, "peak_disk_bytes": int(open(f"{out}/peak").read()),
                                  "bytes_by_kind_after": kinds(f"{out}/drop_after"), "computed": a["computed"]},
           "keep_on_large_disk": {"rc": keep_rc, "wall_s": keep_s, "bytes_by_kind_after": kinds(f"{out}/keep_after")},
           "d1_records_equal": a["cells"] == b["cells"], "d1_records": len(a["cells"])}
json.dump(summary, open(f"{out}/drop_pooled_small_disk.json", "w"), indent=1)
print(json.dumps(summary, indent=1))
PY
