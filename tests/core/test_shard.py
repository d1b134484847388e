"""Sharding: request features and the shard plan (cut size, coverage, prefix groups, the longest work first)."""

from __future__ import annotations

import random

import pytest

from batch_dagster.batchfile.shard import PREFIX_CHARS, UNBOUNDED_OUTPUT_TOKENS, Features, features, plan_shards

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"


def chat_body(user: str, system: str | None = None) -> dict:
    messages = [{"role": "system", "content": system}] if system is not None else []
    messages.append({"role": "user", "content": user})
    return {"model": "m", "messages": messages}


# --- features -------------------------------------------------------------------------------


def test_chat_features_count_all_message_text():
    f = features(CHAT, chat_body("abcde", system="0123456789"))
    assert f.prompt_chars == 15


def test_chat_shared_system_prompt_gives_same_prefix_key():
    a = features(CHAT, chat_body("short question", system="You are a translator."))
    b = features(CHAT, chat_body("a completely different and much longer question", system="You are a translator."))
    c = features(CHAT, chat_body("short question", system="You are a summarizer."))
    assert a.prefix_key == b.prefix_key
    assert a.prefix_key != c.prefix_key
    assert a.prompt_chars < b.prompt_chars


def test_developer_role_counts_as_system_prompt():
    a = {"model": "m", "messages": [{"role": "developer", "content": "Rules."}, {"role": "user", "content": "x"}]}
    b = {"model": "m", "messages": [{"role": "developer", "content": "Rules."}, {"role": "user", "content": "yyyy"}]}
    assert features(CHAT, a).prefix_key == features(CHAT, b).prefix_key


def test_long_system_prompts_differing_after_prefix_chars_are_different_groups():
    base = "s" * (PREFIX_CHARS + 10)
    a = features(CHAT, chat_body("q", system=base + "A"))
    b = features(CHAT, chat_body("q", system=base + "B"))
    assert a.prefix_key != b.prefix_key


def test_chat_without_system_prompt_uses_opening_text():
    opening = "x" * PREFIX_CHARS
    a = features(CHAT, chat_body(opening + " first tail"))
    b = features(CHAT, chat_body(opening + " a different tail"))
    c = features(CHAT, chat_body("y" + opening))
    assert a.prefix_key == b.prefix_key
    assert a.prefix_key != c.prefix_key


def test_chat_content_parts_keep_text_parts():
    body = {
        "model": "m",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "abc"},
                    {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
                    {"type": "text", "text": "de"},
                ],
            }
        ],
    }
    f = features(CHAT, body)
    assert f.prompt_chars == 5
    assert f.prefix_key == features(CHAT, chat_body("abcde")).prefix_key


def test_chat_non_string_content_counts_zero():
    body = {"model": "m", "messages": [{"role": "assistant", "content": None}, {"role": "user", "content": "abc"}]}
    assert features(CHAT, body).prompt_chars == 3


def test_completions_features():
    f = features(COMPLETIONS, {"model": "m", "prompt": "Once upon a time"})
    assert f.prompt_chars == len("Once upon a time")
    g = features(COMPLETIONS, {"model": "m", "prompt": ["ab", "cde"]})
    assert g.prompt_chars == 5
    assert g.prefix_key == features(COMPLETIONS, {"model": "m", "prompt": "ab"}).prefix_key


def test_completions_shared_opening_text():
    opening = "p" * PREFIX_CHARS
    a = features(COMPLETIONS, {"model": "m", "prompt": opening + "1"})
    b = features(COMPLETIONS, {"model": "m", "prompt": opening + "22"})
    assert a.prefix_key == b.prefix_key
    assert (a.prompt_chars, b.prompt_chars) == (PREFIX_CHARS + 1, PREFIX_CHARS + 2)


def test_embeddings_features():
    f = features(EMBEDDINGS, {"model": "e", "input": "hello world"})
    assert f.prompt_chars == 11
    g = features(EMBEDDINGS, {"model": "e", "input": ["a", "bb", "ccc"]})
    assert g.prompt_chars == 6
    h = features(EMBEDDINGS, {"model": "e", "input": ["zz", "bb"]})
    assert g.prefix_key != h.prefix_key


def test_features_are_deterministic_and_hex():
    a = features(CHAT, chat_body("same", system="sys"))
    b = features(CHAT, chat_body("same", system="sys"))
    assert a == b
    int(a.prefix_key, 16)


# --- plan_shards ----------------------------------------------------------------------------


def flat(plan: list[list[int]]) -> list[int]:
    return [i for shard in plan for i in shard]


@pytest.mark.parametrize(("n", "size", "expected"), [(10, 3, [3, 3, 3, 1]), (9, 3, [3, 3, 3]), (2, 5, [2]), (1, 1, [1])])
def test_cuts_at_shard_size(n, size, expected):
    feats = [Features(prompt_chars=i, prefix_key=f"k{i}") for i in range(n)]
    plan = plan_shards(feats, size)
    assert [len(s) for s in plan] == expected


def test_empty_plan():
    assert plan_shards([], 10) == []


@pytest.mark.parametrize("size", [0, -1])
def test_shard_size_must_be_positive(size):
    with pytest.raises(ValueError):
        plan_shards([Features(1, "k")], size)


def test_every_row_exactly_once():
    rng = random.Random(7)
    feats = [Features(rng.randint(1, 500), f"k{rng.randint(0, 20)}") for _ in range(2_345)]
    plan = plan_shards(feats, 100)
    rows = flat(plan)
    assert sorted(rows) == list(range(len(feats)))
    assert all(len(s) == 100 for s in plan[:-1])
    assert len(plan[-1]) == 45


def test_shared_prefix_groups_are_contiguous_and_the_longest_first():
    rng = random.Random(11)
    keys = ["sysA"] * 30 + ["sysB"] * 20 + ["sysC"] * 5 + [f"solo{i}" for i in range(15)]
    rng.shuffle(keys)
    feats = [Features(rng.randint(1, 1000), k) for k in keys]
    order = flat(plan_shards(feats, 7))
    assert sorted(order) == list(range(len(feats)))

    for key in ("sysA", "sysB", "sysC"):
        positions = [p for p, i in enumerate(order) if feats[i].prefix_key == key]
        assert positions == list(range(positions[0], positions[0] + len(positions))), key
        lengths = [feats[order[p]].prompt_chars for p in positions]
        assert lengths == sorted(lengths, reverse=True), key


def test_groups_run_as_blocks_the_block_holding_the_longest_request_first():
    feats = [
        Features(50, "solo1"),  # 0
        Features(10, "B"),  # 1
        Features(30, "A"),  # 2
        Features(5, "solo2"),  # 3
        Features(20, "A"),  # 4
        Features(40, "B"),  # 5
        Features(10, "A"),  # 6
        Features(1, "solo3"),  # 7
    ]
    order = flat(plan_shards(feats, 3))
    # Work is chars // 4 here: solo1 (12), then group B (its longest 10), group A (7), solo2 (1), solo3 (0); each
    # group the longest first.
    assert order == [0, 5, 1, 2, 4, 6, 3, 7]
    # Of two blocks whose longest requests tie, the larger goes first.
    assert flat(plan_shards([Features(8, "solo"), Features(8, "A"), Features(4, "A")], 3)) == [1, 2, 0]


def test_unshared_prompts_go_the_longest_first():
    feats = [Features(c, f"k{i}") for i, c in enumerate([9, 3, 7, 1, 5])]
    assert flat(plan_shards(feats, 2)) == [0, 2, 4, 1, 3]


def test_the_most_output_asked_goes_first_then_the_longest_prompt():
    """A request's work is the output it asks for and its prompt at about 4 characters a token: a short question
    asking 500 tokens runs before a long one asking 16, so the batch's tail is short requests."""
    bodies = [{**chat_body("a" * 400), "max_tokens": 16}, {**chat_body("short"), "max_tokens": 500},
              chat_body("no limit"), {**chat_body("b" * 4000), "max_completion_tokens": 64, "max_tokens": 9000},
              {**chat_body("c" * 40), "max_tokens": 16}]
    feats = [features(CHAT, b) for b in bodies]
    assert [f.max_tokens for f in feats] == [16, 500, UNBOUNDED_OUTPUT_TOKENS, 64, 16]
    assert flat(plan_shards(feats, 10)) == [2, 3, 1, 0, 4]  # work: 4098, 1064, 501, 116, 26
    assert plan_shards(feats, 2) == [[2, 3], [1, 0], [4]]  # the shards too: the longest in the first


def test_the_output_asked_of_each_endpoint():
    assert features(COMPLETIONS, {"model": "m", "prompt": "x"}).max_tokens == 16  # the legacy default
    assert features(COMPLETIONS, {"model": "m", "prompt": "x", "max_tokens": 99}).max_tokens == 99
    assert features(EMBEDDINGS, {"model": "e", "input": "x", "max_tokens": 99}).max_tokens == 0
    assert features(CHAT, {**chat_body("x"), "max_tokens": 10**9}).max_tokens == UNBOUNDED_OUTPUT_TOKENS
    assert features(CHAT, {**chat_body("x"), "max_tokens": "many"}).max_tokens == UNBOUNDED_OUTPUT_TOKENS
    assert features("/v1/responses", {"model": "m", "input": "x", "max_output_tokens": 7}).max_tokens == 7


def test_plan_from_real_bodies_groups_by_system_prompt():
    bodies = []
    for i in range(12):
        system = ["Translate to French.", "Summarize.", None][i % 3]
        bodies.append(chat_body("q" * (12 - i) + str(i), system=system))
    feats = [features(CHAT, b) for b in bodies]
    order = flat(plan_shards(feats, 4))
    groups = [bodies[i]["messages"][0]["content"] if len(bodies[i]["messages"]) == 2 else None for i in order]
    # The two system-prompt groups (4 rows each) come out contiguous.
    for system in ("Translate to French.", "Summarize."):
        pos = [p for p, g in enumerate(groups) if g == system]
        assert pos == list(range(pos[0], pos[0] + 4))


# --- longer shared prefixes (issue 20: documents asked several questions) --------------------


def doc_body(doc: str, question: str) -> dict:
    return chat_body(f"Document:\n{doc}\n\nQuestion: {question}", system="Answer from the document.")


def test_the_prefix_path_follows_the_shared_leading_text():
    from batch_dagster.batchfile.shard import PATH_CHARS, PATH_HEX

    doc = "word " * (3 * PATH_CHARS // 5)  # three full chunks
    a, b = features(CHAT, doc_body(doc, "first?")), features(CHAT, doc_body(doc, "second?"))
    other = features(CHAT, doc_body("other " + doc, "first?"))
    assert a.group == b.group == other.group  # one system prompt
    assert a.path == b.path and len(a.path) == 3 * PATH_HEX  # the document's chunks agree
    assert a.path[:PATH_HEX] != other.path[:PATH_HEX]  # another document: the first chunk already differs
    assert features(CHAT, chat_body("x" * 10 * PATH_CHARS)).path == features(CHAT, chat_body("x" * 11 * PATH_CHARS)).path[:10 * PATH_HEX]


def _docqa(docs: int, questions: int, seed: int = 3) -> tuple[list[dict], list[Features]]:
    rng = random.Random(seed)
    rows = [(d, q) for d in range(docs) for q in range(questions)]
    rng.shuffle(rows)
    text = {d: " ".join(f"w{rng.randint(0, 999)}" for _ in range(400)) for d in range(docs)}
    bodies = [doc_body(text[d], f"question {q} " + "?" * rng.randint(1, 30)) for d, q in rows]
    return [{"doc": d} for d, _ in rows], [features(CHAT, b) for b in bodies]


def test_a_documents_questions_are_together_and_in_one_shard():
    rows, feats = _docqa(30, 5)
    plan = plan_shards(feats, 40)  # 150 rows: 4 shards, 10 rows of room to move cuts
    order = flat(plan)
    assert sorted(order) == list(range(150)) and len(plan) == 4
    docs = [rows[i]["doc"] for i in order]
    runs = [d for p, d in enumerate(docs) if p == 0 or docs[p - 1] != d]
    assert len(runs) == 30  # each document's questions contiguous: one run per document
    for d in range(30):  # ... and the longest first within it
        lengths = [feats[i].prompt_chars for i in order if rows[i]["doc"] == d]
        assert lengths == sorted(lengths, reverse=True)
    shards_per_doc = [len({p for p, s in enumerate(plan) for i in s if rows[i]["doc"] == d}) for d in range(30)]
    assert shards_per_doc == [1] * 30  # no document cut in two
    assert all(len(s) <= 40 for s in plan)


def test_cuts_never_make_more_shards_than_plain_cutting():
    rows, feats = _docqa(30, 5)
    assert [len(s) for s in plan_shards(feats, 50)] == [50, 50, 50]  # no room: cut where shard_size says
    assert len(plan_shards(feats, 7)) == -(-150 // 7)


def test_a_unique_tail_after_a_shared_system_prompt_keeps_the_longest_first():
    from batch_dagster.batchfile.shard import PATH_CHARS

    system = "Long rules. " * PATH_CHARS  # many shared chunks
    rng = random.Random(5)
    bodies = [chat_body("".join(rng.choices("abcdef", k=rng.randint(1, 3 * PATH_CHARS))), system=system)
              for _ in range(40)]
    feats = [features(CHAT, b) for b in bodies]
    order = flat(plan_shards(feats, 100))
    assert [feats[i].prompt_chars for i in order] == sorted((f.prompt_chars for f in feats), reverse=True)


def test_planning_stays_fast_for_many_rows():
    import time

    rng = random.Random(1)
    keys = [f"{rng.getrandbits(64):016x}" + f"{rng.getrandbits(64):016x}" * rng.randint(0, 8) for _ in range(50_000)]
    feats = [Features(rng.randint(1, 5000), k) for k in keys]
    started = time.perf_counter()
    plan = plan_shards(feats, 1000)
    assert time.perf_counter() - started < 5 and len(plan) == 50


# --- the output the batch's earlier shards wrote --------------------------------------------


def _answered(cid: str, completion_tokens: int, status: int = 200) -> dict:
    usage = {"completion_tokens": completion_tokens}
    return {"custom_id": cid, "response": {"status_code": status, "body": {"usage": usage}}}


def test_the_shares_written_reorder_the_next_shard_a_group_that_writes_little_goes_after_one_that_writes_all():
    from batch_dagster.batchfile.shard import ALL_GROUPS, OutputShares, running_order

    def ask(cid, system, max_tokens):
        return cid, {**chat_body(f"{cid} question", system=system), "max_tokens": max_tokens}

    first = [ask("t1", "Translate.", 100), ask("t2", "Translate.", 100), ask("l1", "Label.", 100),
             ask("l2", "Label.", 100)]
    written = OutputShares()
    written.add(CHAT, first, [_answered("t1", 90), _answered("t2", 70), _answered("l1", 4), _answered("l2", 6),
                              _answered("nobody", 50)])  # a line of no request here counts for nothing
    written.add(CHAT, first, [_answered("t1", 1000, status=400)])  # an error line wrote nothing it asked
    shares = written.shares()
    assert shares[features(CHAT, first[0][1]).group] == 0.8 and shares[features(CHAT, first[2][1]).group] == 0.05
    assert shares[ALL_GROUPS] == 170 / 400
    # The next shard: labels ask more (300) than translations (200), but write a twentieth of it.
    second = [ask("l3", "Label.", 300), ask("l4", "Label.", 300), ask("t3", "Translate.", 200),
              ask("t4", "Translate.", 200), ask("new", "Unseen.", 250), ask("new2", "Unseen.", 10)]
    cids = lambda order: [second[i][0] for i in order]  # noqa: E731
    assert cids(running_order(CHAT, second)) == ["l3", "l4", "new", "new2", "t3", "t4"]  # by what they ask
    # By what they write: translations (160) before the new group (at every group's share: 106) and labels (15).
    assert cids(running_order(CHAT, second, shares)) == ["t3", "t4", "new", "new2", "l3", "l4"]
    assert OutputShares().shares() == {}  # nothing run yet: every request weighs what it asks
