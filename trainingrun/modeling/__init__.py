"""The model layer, below the programs (it imports nothing from trainer/, rollout/, vllm/ or api/):

  architecture.py  the typed, frozen `Architecture`, presets and family defaults, spec fields → `resolve` (no torch)
  hf_config.py     Hugging Face config.json ↔ Architecture (no torch)
  memory.py        the memory plan: what each role holds per GPU (per process on a CPU), term by term (no torch)
  convert.py       Megatron ↔ Hugging Face weight names and shapes, tensor-parallel split/gather rules
  hf_io.py         Hugging Face directories: safetensors in and out, tokenizer/config assets
  model.py         device + process groups + seed, `build_model` (the one Megatron GPT builder), canonical weights in
  attention.py     core attentions of packed (THD) sequences: sdpa (one causal SDPA call per document), flash
  cpu_compat.py    the CPU shim that lets megatron-core run on a CPU-only torch (CPU mode only)
  state.py         a live model's weights: numpy arrays and back, the tensor-parallel gather of the full state
  score.py         per-token log-probabilities of token lines (`trainingrun score`'s model)
  tokenizer.py     the run's tokenizer (model.hf's tokenizer.json, chat template)
  gguf.py          GGUF → Hugging Face for the SmolLM2 example (`trainingrun gguf-to-hf`)
"""
