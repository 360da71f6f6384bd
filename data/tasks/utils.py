"""WinoGrande partial evaluation as in lm-eval's winogrande task, on the uniform eval records
({"question": sentence with one "_", "choices": [option1, option2], "gold": 0|1}).

The two candidate contexts are the sentence prefix with each option filled in; the target scored
after each is the shared remainder of the sentence.
"""
from __future__ import annotations


def winogrande_doc_to_text(doc: dict) -> int:
    # lm-eval convention for multiple-context tasks: doc_to_text returns the gold context index
    return int(doc["gold"])


def winogrande_doc_to_target(doc: dict) -> str:
    idx = doc["question"].index("_") + 1
    return doc["question"][idx:].strip()


def winogrande_doc_to_choice(doc: dict) -> list[str]:
    idx = doc["question"].index("_")
    return [doc["question"][:idx] + opt for opt in doc["choices"]]
