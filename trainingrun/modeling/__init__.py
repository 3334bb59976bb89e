"""Real models: Hugging Face config and weight conversion, the run's tokenizer, `trainingrun export-hf`,
`trainingrun score`, and GGUF → Hugging Face for the SmolLM2 example. Building the Megatron model lives in
`trainingrun.trainer.model.build_model`."""
