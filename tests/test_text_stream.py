"""Streamed text: only ever grows, equals the final text, holds back what may still change, trims after a stop."""

from __future__ import annotations

from rapidspec.text_stream import TextAssembler


class PieceTokenizer:
    """Token i decodes to PIECES[i]; clean-up (when asked) rewrites " ." to "." as transformers' does."""

    PIECES = ["Hello", " world", " .", " And", " then", " END", " more", "\ufffd", " é"]

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=True):
        text = "".join(self.PIECES[i] for i in ids)
        if any(i == 7 for i in ids) and ids[-1] != 7:  # a split character completed by the next token
            text = text.replace("\ufffd", "")
        return text.replace(" .", ".") if clean_up_tokenization_spaces else text


def stream(token_rounds, stop=()):
    assembler = TextAssembler(PieceTokenizer(), stop)
    released, stopped = [], False
    for tokens in token_rounds:
        text, stopped = assembler.add(tokens)
        released.append(text)
        if stopped:
            break
    if not stopped:
        released.append(assembler.flush())
    return assembler, released, stopped


def test_streamed_text_only_grows_and_equals_the_final_text_even_where_clean_up_would_rewrite_it():
    assembler, released, _ = stream([[0, 1], [2], [3, 4]])
    assert "".join(released) == assembler.text == "Hello world . And then"
    assert released[1] == " ."  # never stalls: the text after a would-be rewrite is released at once


def test_a_partial_character_is_held_until_it_is_complete():
    assembler, released, _ = stream([[0, 7], [8]])
    assert released[0] == "Hello" and "\ufffd" not in "".join(released)


def test_a_stop_string_ends_the_answer_and_drops_the_tokens_after_it():
    assembler, released, stopped = stream([[0, 1], [3, 5, 6, 4]], stop=(" END",))
    assert stopped and assembler.text == "Hello world And" and "".join(released) == assembler.text
    assert assembler.kept == 2  # " And" and " END"; " more" and " then" are not part of the answer


def test_a_possible_start_of_a_stop_string_is_held_back_until_decided():
    assembler = TextAssembler(PieceTokenizer(), stop=(" world!",))
    assert assembler.add([0]) == ("Hello", False)
    assert assembler.add([1]) == ("", False)  # " world" may begin " world!"
    assert assembler.add([2]) == (" world .", False)
