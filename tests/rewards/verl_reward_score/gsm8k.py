import re


def extract_solution(solution_str, method="strict"):
    assert method in ["strict", "flexible"]
    if method == "strict":
        solutions = re.findall("#### (\\-?[0-9\\.\\,]+)", solution_str[-300:])
        return solutions[-1].replace(",", "").replace("$", "") if solutions else None
    answers = [a for a in re.findall("(\\-?[0-9\\.\\,]+)", solution_str) if a not in ("", ".")]
    return answers[-1] if answers else None


def compute_score(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0):
    """GSM8K: `score` for the right number after ####, `format_score` for a wrong one."""
    answer = extract_solution(solution_str=solution_str, method=method)
    if answer is None:
        return 0
    return score if answer == ground_truth else format_score
