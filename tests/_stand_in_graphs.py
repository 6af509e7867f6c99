"""CUDA graphs on a CPU, stood in for: every key of a :class:`CudaGraphManager` made
for the engine's runner (sizes 1, 2, 4 and the given query lengths) gets a "graph" whose
replay runs the captured forward (the graph's padded batch, query length and width)
eagerly, so the runner takes its graph path and the test sees which keys replayed."""

from __future__ import annotations

from typing import Any

from pdserve.runner.cuda_graph import CudaGraphManager


def stand_in_graphs(
    llm: Any,
    replayed: list[tuple[int, int, int]] | None = None,
    query_lens: tuple[int, ...] = (1,),
) -> CudaGraphManager:
    runner = llm.engine.runner
    g = CudaGraphManager(runner.step, [1, 2, 4], query_lens)

    class Replay:
        def __init__(self, key: tuple[int, int, int]) -> None:
            self.key = key

        def replay(self) -> None:
            if replayed is not None:
                replayed.append(self.key)
            g.outputs[self.key] = g._forward(*self.key)

    for q in query_lens:
        for size in g.sizes:
            for width in g.widths:
                g.graphs[(size, q, width)] = Replay((size, q, width))  # type: ignore[assignment]
    runner.graphs = g
    return g
