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


def test_a_resumed_request_continues_its_text_exactly(tokenizer):
    """After an engine restart a request is resent with its earlier output at the end of the prompt; the
    new detokenizer replays it: the client's text is the same as without the restart, whatever was held
    back, and a stop string that straddles the resend point is found."""
    from engine.core.outputs import TokenOutput
    from engine.output_processor import OutputProcessor
    prompt = tokenizer("Say it:", add_special_tokens=False)["input_ids"]
    for text, stop in [("Grüße aus Köln 🙂 — 東京 and more words", []),
                       ("alpha beta ST", ["STOP"]), ("alpha beta STOP gamma delta", ["STOP"])]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for cut in range(1, len(ids)):
            first = OutputProcessor(tokenizer)
            first.add("r", prompt, stop, False)
            got, stopped = "", False
            for i, t in enumerate(ids[:cut]):
                (out,), done, _ = first.process([TokenOutput("r", [t], None, 0, 0, 0)])
                got, stopped = got + out.text, bool(done)
                if stopped:
                    break
            if stopped:
                continue                                # finished before the restart: nothing to resend
            again = OutputProcessor(tokenizer)
            again.add("r", prompt + ids[:cut], stop, False, resumed=cut, resumed_chars=len(got))
            for i, t in enumerate(ids[cut:]):
                reason = "length" if cut + i == len(ids) - 1 else None
                (out,), done, _ = again.process([TokenOutput("r", [t], reason, 0, 0, 0)])
                got += out.text
                if done or out.finish_reason:
                    break
            whole, _ = stream(tokenizer, text, stop)
            assert got == "".join(whole), (text, cut)


def test_text_is_what_the_tokenizer_decodes_special_tokens_skipped(tokenizer):
    """The fast path (the backend tokenizer) gives tok.decode's text, special tokens dropped."""
    ids = tokenizer("Hello  world,\n\tspaces  ", add_special_tokens=False)["input_ids"]
    ids = [tokenizer.eos_token_id, *ids[:3], tokenizer.eos_token_id, *ids[3:]]
    d = Detokenizer(tokenizer, [], [])
    text = "".join(d.update([t], i == len(ids) - 1) for i, t in enumerate(ids))
    assert text == tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
