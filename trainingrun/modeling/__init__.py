"""The model layer, below the programs (it imports nothing from trainer/, rollout/, engines/ or api/).

Module map:
  architecture.py  the typed, frozen `Architecture`, presets and family defaults, spec fields → `resolve` (no torch)
  hf_config.py     Hugging Face config.json ↔ Architecture (no torch)
  memory.py        the memory plan: what each role holds per GPU (per process on a CPU), term by term (no torch)
  sync_plan.py     the streamed weight sync's plan: tensors in order → buckets, the ranks owning each part (no torch)
  stream.py        the streamed gather: a live model's full state bucket by bucket over TP ranks and PP stages
  convert.py       Megatron ↔ Hugging Face weight names and shapes, tensor-parallel split/gather rules
  pipeline.py      the layers of each pipeline stage; weight names between a stage and the whole model (no torch)
  hf_io.py         Hugging Face directories: safetensors in and out, tokenizer/config assets
  model.py         device + process groups + seed, `build_model` (the one Megatron GPT builder), canonical weights in
  initialise.py    the seeded initialisation, the same at every tensor-, pipeline- and expert-parallel layout
  lora_targets.py  LoRA's plan: the targeted layers, the adapters' parts and shapes, the checks against the model
                   (no torch)
  lora.py          LoRA adapters on Megatron's linear layers: frozen base, seeded layout-independent A, merged
                   weights for the publishers and checkpoints, PEFT adapters in and out
  lora_base.py     the base a LoRA run's adapters belong to: its reference and digest in checkpoints, the base
                   rebuilt from them (export-hf, score)
  attention.py     core attentions of packed (THD) sequences: sdpa (one causal SDPA call per document), flash
  cpu_compat.py    the CPU shim that lets megatron-core run on a CPU-only torch (CPU mode only)
  moe.py           mixture-of-experts hooks at run time: routing record/replay, the per-sample balance loss, router
                   statistics
  state.py         a live model's weights: numpy arrays and back; the full state gathered over tensor- and
                   expert-parallel ranks, pipeline stages joined
  score.py         per-token log-probabilities of token lines (`trainingrun score`'s model)
  tokenizer.py     the run's tokenizer (model.hf's tokenizer.json, chat template)
  gguf.py          GGUF → Hugging Face for the SmolLM2 example (`trainingrun gguf-to-hf`)
"""
