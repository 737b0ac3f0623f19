"""The decoding loop: the speculative session (speculative.py: draft, verify, accept, trim, plan),
γ's governor, the sampling maths, text in and out, the MTP draft and the run's metrics. It drives
the engine (orchestrator.runtime) and asks a policy (orchestrator.policies) for each step's plan."""
