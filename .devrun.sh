source scripts/gpu-env
start=$(date +%s)
echo "commit $PDSERVE_COMMIT"; nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python3 benchmarks/prefill_sweep.py --sections mla_variants --budget-s 60 \
  --out "$OUT/mla_variants.json" > "$OUT/mla_variants.log" 2>&1; echo "sweep: exit $?"
grep -v '^{' "$OUT/mla_variants.log" | tail -30
timeout 300 python3 benchmarks/spec_bench.py --sections decode --configs 0,3a --rates 0.5 \
  --streams 128,224 --profile-streams 224 --out "$OUT/spec_j0.json" > "$OUT/spec_j0.log" 2>&1
echo "spec_bench: exit $?"; sed -n '/: decode at a/,$p' "$OUT/spec_j0.log" | head -60
left=$(( start + 540 - $(date +%s) ))
[ "$left" -gt 60 ] && { timeout "$left" python3 benchmarks/launch_count.py --device cuda \
  --out "$OUT/launches.json" > "$OUT/launches.log" 2>&1; echo "launch_count: exit $?"; tail -30 "$OUT/launches.log"; }
true
