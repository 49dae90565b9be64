"""The embedded toy Video-LLM: procedural clips, questions, tokenizer, training and evaluation.

`python -m sparsevid.toy train|eval|examples --help`.
"""
import os

DEFAULT_MODEL_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                 "assets", "toy-qwen2vl")
