def last_boxed_only_string(string):
    idx = string.rfind("\\boxed")
    if idx < 0:
        return None
    depth = 0
    for i in range(idx, len(string)):
        if string[i] == "{":
            depth += 1
        elif string[i] == "}":
            depth -= 1
            if depth == 0:
                return string[idx : i + 1]
    return None


def remove_boxed(s):
    left = "\\boxed{"
    assert s[: len(left)] == left
    assert s[-1] == "}"
    return s[len(left) : -1]


def strip_string(string):
    return string.replace(" ", "").replace("\\dfrac", "\\frac").rstrip(".")


def compute_score(solution_str, ground_truth) -> float:
    retval = 0.0
    try:
        string_in_last_boxed = last_boxed_only_string(solution_str)
        if string_in_last_boxed is not None:
            answer = remove_boxed(string_in_last_boxed)
            if strip_string(answer) == strip_string(ground_truth):
                retval = 1.0
    except Exception as e:
        print(e)
    return retval
