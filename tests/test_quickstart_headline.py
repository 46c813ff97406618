"""The quickstart's terminal headline: over many languages, the per-group summary (cross-lingual, non-English,
English, all) instead of the table with a column per test set, which stays in the report."""

from __future__ import annotations

from moembed.recipes.report import print_headline
from moembed.recipes.report_text import group_summary

TEST_SETS = {  # two cross-lingual sets, two in other languages, one in English
    "freedict-deu-eng": {"query_lang": "de", "doc_lang": "en"},
    "freedict-fra-eng": {"query_lang": "fr", "doc_lang": "en"},
    "chatterbot-german": {"query_lang": "de", "doc_lang": "de"},
    "chatterbot-french": {"query_lang": "fr", "doc_lang": "fr"},
    "wordnet": {"query_lang": "en", "doc_lang": "en"},
}
SCORES = {  # nDCG@10 per test set, in TEST_SETS' order
    "base": [0.40, 0.50, 0.30, 0.50, 0.60],
    "dense": [0.60, 0.70, 0.50, 0.60, 0.70],
    "moe": [0.70, 0.70, 0.40, 0.60, 0.80],
}
SUMMARY = {m: {"per_task": dict(zip(TEST_SETS, xs))} for m, xs in SCORES.items()}


def test_group_summary_averages_each_group_of_test_sets():
    rows = group_summary(SUMMARY, TEST_SETS).splitlines()
    assert rows[0] == "| test sets | n | base | dense | MoE | MoE − dense |"
    assert rows[2:] == [
        "| cross-lingual | 2 | 45.0 | 65.0 | 70.0 | +5.0 |",
        "| non-English | 2 | 40.0 | 55.0 | 50.0 | -5.0 |",
        "| English | 1 | 60.0 | 70.0 | 80.0 | +10.0 |",
        "| all | 5 | 46.0 | 62.0 | 64.0 | +2.0 |",
    ]


def test_a_group_without_test_sets_is_left_out():
    english = {"wordnet": TEST_SETS["wordnet"]}
    rows = group_summary(SUMMARY, english).splitlines()[2:]
    assert [r.split(" | ")[0] for r in rows] == ["| English", "| all"]


def test_the_terminal_prints_the_groups_and_not_the_wide_table(capsys):
    table = "| model | " + " | ".join(TEST_SETS) + " |"
    result = {"table": table, "verdict": "No clear winner.", "groups": group_summary(SUMMARY, TEST_SETS),
              "decisions": {}}
    print_headline(result)
    out = capsys.readouterr().out
    assert "| cross-lingual | 2 |" in out and "No clear winner." in out and table not in out
    print_headline({**result, "groups": None})  # an English run, or a report written before the groups
    assert table in capsys.readouterr().out
