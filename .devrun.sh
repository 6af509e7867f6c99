source scripts/gpu-env
nvidia-smi --query-gpu=name --format=csv,noheader
cat > /tmp/j0sync.py <<'PY'
import sys, time, warnings, traceback
import torch
from pathlib import Path
from pdserve import LLM, SamplingParams
from pdserve.testing.checkpoint import make_checkpoint
import pdserve.engine.sched.spec as specmod
from pdserve.runner import step_inputs as si
mode = sys.argv[1]
path = Path("/tmp/j0ck")
if not (path / "config.json").exists():
    make_checkpoint("GlmMoeDsaForCausalLM", "glm5-s4-e16", path, dtype="bfloat16", device="cpu", config_only=True)
spec = None
if mode != "plain":
    spec = {"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic",
            "synthetic_acceptance_rate": 0.5, "draft_policy": "adaptive"}
    orig = specmod.SpecSchedule.begin_step
    def begin(self, *a, **k):
        orig(self, *a, **k)
        if self.k > 0 and mode == "j0":
            self.step_drafts = 0; self.proposing = False
    specmod.SpecSchedule.begin_step = begin
waits = {"staging": 0.0}
cls = si.StepPreparer
ow = cls.wait_staging
def ws(self):
    t = time.perf_counter(); ow(self); waits["staging"] += time.perf_counter() - t
cls.wait_staging = ws
llm = LLM(str(path), device="cuda", dtype="bfloat16", load_format="dummy", max_model_len=2048,
          max_num_seqs=64, max_num_batched_tokens=4096, speculative_config=spec,
          kv_cache_memory_bytes=4 << 30, compilation_config={"cudagraph_capture_sizes": [64]})
eng = llm.engine
sp = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
for i in range(64):
    eng.add_request(llm.processor.make_request(f"r{i}", [1 + i] + list(range(2, 500)), sp))
for _ in range(12):
    eng.step()
torch.cuda.synchronize()
for _ in range(4):
    w0, t = eng.pipeline.waited_s, time.perf_counter()
    eng.step()
    print(mode, "step %.2f ms, done-wait %.2f ms" % ((time.perf_counter()-t)*1e3, (eng.pipeline.waited_s-w0)*1e3))
PY
for m in plain j0; do timeout 150 python3 /tmp/j0sync.py $m 2>&1 | grep -v "^INFO\|Warning: \|^\s*$" | tail -60; done
