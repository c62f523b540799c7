from engine.detokenizer import Detokenizer


def stream(tok, text, stop=(), include=False):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    d = Detokenizer(tok, [], list(stop), include)
    deltas = [d.update([t], i == len(ids) - 1) for i, t in enumerate(ids)]
    return deltas, d


def test_deltas_concatenate_to_the_text_across_multibyte_characters(tokenizer):
    text = "Grüße aus Köln 🙂 — 東京 and more"
    deltas, d = stream(tokenizer, text)
    assert "".join(deltas) == text == d.text
    assert all("\ufffd" not in x for x in deltas)


def test_stop_string_cuts_and_holds_back_partial_matches(tokenizer):
    deltas, d = stream(tokenizer, "alpha beta STOP gamma", stop=["STOP"])
    assert d.stopped and d.text == "alpha beta " and "".join(deltas) == "alpha beta "
    deltas, d = stream(tokenizer, "alpha beta STOP gamma", stop=["STOP"], include=True)
    assert "".join(deltas) == "alpha beta STOP"
