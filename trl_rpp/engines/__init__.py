"""The vLLM engines' weight sync where TRL's cannot work: a colocated engine on vLLM's CPU backend
(`vllm_colocate`), and a server without NCCL, through a directory (`vllm_server`)."""
