"""Where a step's time and bytes go, measured or modelled on the model itself (the bench
package speaks only HTTP): ``step_profile`` (a ``torch.profiler`` capture of one engine
step by kernel category), ``launch_count`` (device launches per decode step, counted on
any machine), ``decode_roofline`` (the bytes a decode step must read),
``prefill_flops`` (the matrix FLOPs of a prefill) and ``kernel_compiles`` (the Triton
variants compiled so far: traffic may add none). Used by ``benchmarks/glm5_bench.py``,
``benchmarks/spec_bench.py`` and ``benchmarks/launch_count.py``. Modules are imported on
use, not here.
"""
