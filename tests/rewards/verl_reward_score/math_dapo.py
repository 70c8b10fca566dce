import re
from typing import Optional


def normalize_final_answer(final_answer: str) -> str:
    final_answer = final_answer.split("=")[-1]
    for before, after in [("\\$", ""), (" ", ""), ("\\text{}", "")]:
        final_answer = final_answer.replace(before, after)
    final_answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", final_answer).replace("$", "")
    if final_answer.replace(",", "").isdigit():
        final_answer = final_answer.replace(",", "")
    return final_answer.strip()


def is_correct_minerva(solution_str: str, gt: str, answer_pattern: str = r"(?i)Answer\s*:\s*([^\n]+)"):
    match = re.findall(answer_pattern, solution_str)
    pred = normalize_final_answer(match[-1] if match else "[INVALID]")
    return pred == normalize_final_answer(gt), pred


def compute_score(
    solution_str: str,
    ground_truth: str,
    strict_box_verify: bool = False,
    pause_tokens_index: Optional[list[int]] = None,  # noqa: UP045 - as verl writes it
) -> float:
    """DAPO: +1 / -1 on the last "Answer:" line; returns a dict with "score"."""
    if pause_tokens_index is not None:
        assert len(pause_tokens_index) == 4
    solution_str = solution_str[-300:]
    correct, pred = is_correct_minerva(solution_str, ground_truth)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
