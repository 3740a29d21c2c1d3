"""Benchmarks (chapter 08): `nanoengine bench` and `bench.run.bench(...)`.

- `workload`: seeded workloads (nano-vllm's exact draw, cpu-small, shared-prefix, multi-prefix, smoke),
  Poisson arrivals;
- `hardware`: the machine's GEMM peak and memory bandwidth, measured on the spot;
- `roofline`: the workload's FLOPs and bytes, and the time bounds they imply;
- `metrics`: percentiles, TTFT / TPOT, per-step engine numbers;
- `peers`: transformers static batches, vLLM and nano-vllm (GPU only);
- `run`: one run of the engine and its peers; `report`: table and JSON; `plots`: the figure.
- `token_budget` (chapter 05): TTFT and ITL against `max_num_batched_tokens`, decode-first beside a
  prefill-first illustration.
- `routing` (`python -m nanoengine.bench.routing`): cache-aware against round-robin routing through
  `nanoengine serve --data-parallel-size 2` on the multi-prefix workload.
"""
