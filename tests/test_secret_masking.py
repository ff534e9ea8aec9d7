"""Secret values are masked in every output line, including each line of a multi-line value."""

from orchestrator.agents.secrets import SecretMasker

PEM = "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0B\n-----END PRIVATE KEY-----"


def test_values_and_each_line_of_a_multi_line_value_are_masked():
    mask = SecretMasker(["hf_abcdef123456", PEM, "abc"])
    assert mask("token=hf_abcdef123456 ok") == "token=***** ok"
    assert [mask(line) for line in PEM.splitlines()] == ["*****"] * 3
    assert mask("the key is MIIEvQIBADANBgkqhkiG9w0B") == "the key is *****"
    assert mask("abc is too short to mask") == "abc is too short to mask"
