"""vLLM's CPU platform only: faster pieces of vLLM's own sampler and verifier, Ray on CPU."""
