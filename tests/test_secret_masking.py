"""Secret values are masked in every output line, including each line of a multi-line value."""

import random

from orchestrator.node.secrets import SecretMasker, StreamMasker

PEM = "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0B\n-----END PRIVATE KEY-----"


def test_values_and_each_line_of_a_multi_line_value_are_masked():
    mask = SecretMasker(["hf_abcdef123456", PEM, "abc"])
    assert mask("token=hf_abcdef123456 ok") == "token=***** ok"
    assert [mask(line) for line in PEM.splitlines()] == ["*****"] * 3
    assert mask("the key is MIIEvQIBADANBgkqhkiG9w0B") == "the key is *****"
    assert mask("abc is too short to mask") == "abc is too short to mask"


def test_a_terminal_stream_cut_anywhere_never_lets_a_secret_through():
    """A shell's output reaches the client in arbitrary pieces; a secret split across two of them
    is still masked, and what only looked like the start of one comes out unchanged."""
    secret = "hunter2-very-secret"
    stream = f"$ echo {secret}\r\nok {secret[:5]} done é{secret}\r\n".encode()
    expected = stream.decode().replace(secret, "*****").encode()
    rng = random.Random(7)
    for _ in range(200):
        masker = StreamMasker(SecretMasker([secret]))
        cuts = sorted(rng.sample(range(1, len(stream)), 6))
        pieces = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
        out = b"".join(masker.feed(piece) for piece in pieces) + masker.feed(b"", final=True)
        assert out == expected
    masker = StreamMasker(SecretMasker([secret]))
    assert masker.feed(b"abc hun") == b"abc "  # might be the secret: held back ...
    assert masker.feed(b"gry\r\n") == b"hungry\r\n"  # ... until the next piece says it is not
