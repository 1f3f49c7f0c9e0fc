"""Iteration-level generation for decoupled Python models (docs/generation.md): a decoder
language model run one decode step at a time over a batch that sequences join and leave
between steps, as Triton's vLLM backend runs its engine inside a Python model.

- planner.py: which waiting sequences join the batch at a step (pure).
- decoder.py: the exported decoder's two Paddle programs (prefill, decode) and their cache.
- sampling.py: greedy or seeded temperature sampling of one token.
- tokenizer.py: the char-level vocabulary of the example's LM.
- engine.py: the driver thread that runs the steps and answers through response senders.
"""
