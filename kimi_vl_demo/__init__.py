"""The logic of the Kimi-VL web demo (app.py), free of Gradio so that tests and benchmarks drive it directly.

inputs.py        what users send: upload limits, header-only image checks, decoding, the context check
conversation.py  the conversation kept in the session: history entries, what the model and the chat see of it
checkpoints.py   which checkpoint to serve (hub, local folder, tiny fallback) and loading its model
engine.py        ChatEngine (processor + model, one generation at a time), answering a turn, releasing memory
stats.py         per-answer statistics: the generation monitor, how an answer ended, the stats text
"""

import sys


def log(message: str) -> None:
    print(f"[kimi-vl demo] {message}", file=sys.stderr, flush=True)
