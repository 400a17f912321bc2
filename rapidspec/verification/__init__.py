"""The math of one verification, pure functions over tensors.

``sampling`` (p-hat = softmax(z/T + eta g), acceptance and the residual), ``penalties`` (frequency, presence and
repetition penalties along a drafted path) and ``logprobs`` (the log-probabilities an answer reports). The
engine verifies with them and the drafter samples its drafts with the same functions.
"""
