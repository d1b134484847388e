"""Whose cached work a batch touches: each owner a scope of its own, the owners the operator names sharing one; the
prefix-cache salt a keyed hash of the scope (and of the request's own salt, within it)."""

from __future__ import annotations

from batch_dagster.features.scope import SHARED, Owner, cache_salt, salted, scope

ALICE, BOB = Owner("a" * 64, "alice"), Owner("b" * 64, "bob")


def test_each_owner_is_a_scope_of_its_own_unless_the_operator_shares():
    assert scope(ALICE, (), "batch_1") != scope(BOB, (), "batch_1")
    assert scope(ALICE, (), "batch_1") == scope(ALICE, (), "batch_2")  # the owner's, whatever its batch
    assert scope(ALICE, ["alice", "bob"], "x") == scope(BOB, ["alice", "bob"], "y") == SHARED
    assert scope(BOB, ["alice"], "x") != SHARED and scope(BOB, ["*"], "x") == SHARED
    # A table batch's namespace is its owner; the same name as a key's is still another owner.
    assert scope(Owner.of_table("alice"), (), "x") != scope(ALICE, (), "x")
    assert scope(Owner.of_table("team"), ["team"], "x") == SHARED
    # An owner not known shares nothing beyond its batch, even with `*`.
    assert scope(Owner(), ["*"], "batch_1") == "batch:batch_1" != scope(Owner(), ["*"], "batch_2")


def test_the_salt_is_a_keyed_hash_of_the_scope_and_the_requests_own():
    mine = cache_salt("owner:a", "")
    assert len(mine) == 64 and mine != cache_salt("owner:b", "") and mine == cache_salt("owner:a", "")
    assert mine != cache_salt("owner:a", "a secret")  # the operator's secret changes every salt
    assert cache_salt("owner:a", "", "user-1") not in (mine, cache_salt("owner:b", "", "user-1"))


def test_every_request_is_salted_and_a_salt_vllm_refuses_is_left_to_be_refused():
    requests = [("plain", {"prompt": "x"}), ("own", {"prompt": "x", "cache_salt": "user-1"}),
                ("bad", {"prompt": "x", "cache_salt": "a/b"}), ("long", {"prompt": "x", "cache_salt": "s" * 129}),
                ("empty", {"prompt": "x", "cache_salt": ""})]
    out = dict(salted(requests, "owner:a", ""))
    assert out["plain"]["cache_salt"] == cache_salt("owner:a", "")
    assert out["own"]["cache_salt"] == cache_salt("owner:a", "", "user-1")
    assert [out[cid]["cache_salt"] for cid in ("bad", "long", "empty")] == ["a/b", "s" * 129, ""]
    assert requests[0][1] == {"prompt": "x"}  # the bodies given are left as they were
