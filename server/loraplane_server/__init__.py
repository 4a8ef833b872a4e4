"""loraplane's server: one base model, many LoRA adapters, continuous batching.

The packages follow a request's path, top to bottom; each may import only the packages below it (its
`__init__` names them; tests/test_import_graph.py holds every package to its line):

    serving/    the front: the CLI, the HTTP APIs (LoRAX, OpenAI, vLLM admin), the router
    engine/     the engine core: LLMEngine's step loop, the asyncio front, scheduler, paged KV bookkeeping
    spec/       speculative decoding: prompt lookup and the draft model propose, the policy decides
    adapters/   adapters acquired and made resident: PEFT reading, host and disk tiers, device slots
    store/      where models and adapters come from: sources (hf://, s3://, http, local), the model cache
    executor/   one step on the device: model runner, batch, sampler, models, layers, attention, LoRA compute
    kernels/    the compiled kernels: C++ for the CPU (csrc/) and its loader, Triton for CUDA
    platforms/  the machine: CPU features, torch threads, the CUDA device and its memory, the user cache

The modules at this level are the vocabulary every stage shares, which any package may import: `config`
(EngineConfig), `errors`, `sampling_params`, `sequence` (a request's state), `detokenizer` and
`request_output`. They import each other and, of the packages, only a sequence's speculation state:

May import: spec.policy.
"""
