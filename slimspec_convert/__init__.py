"""SlimSpec: low-rank LM heads for EAGLE-3 drafters (arXiv 2605.10453).

Convert a trained EAGLE-3 drafter's lm_head ``W [V_d, d]`` into ``W_up [V_d, r] @ W_down [r, d]``
by truncated SVD, recover acceptance with a short KL fine-tune, and run lossless speculative
decoding with it.
"""

__version__ = "0.1.0"
