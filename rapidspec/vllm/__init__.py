"""RAPID's drafter inside vLLM (docs/vllm.md), and where vLLM lives for rapidspec (:mod:`.environment`)."""
