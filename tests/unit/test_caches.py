"""caches.py: FP8_GRPO_CACHE_DIR points every compile/JIT cache that the user left unset into one directory."""

import caches


def test_one_directory_for_the_unset_caches(tmp_path):
    env = {"FP8_GRPO_CACHE_DIR": str(tmp_path / "c"), "TRITON_CACHE_DIR": "/mine"}
    done = caches.use_cache_dir(env)
    assert env["TRITON_CACHE_DIR"] == "/mine" and "TRITON_CACHE_DIR" not in done  # the user's own wins
    assert done == {v: str(tmp_path / "c" / sub) for v, sub in caches.SUBDIRS.items() if v != "TRITON_CACHE_DIR"}
    assert all(env[v] == d and (tmp_path / "c").joinpath(d).is_dir() for v, d in done.items())
    assert caches.use_cache_dir(env) == {}  # a second call finds them set


def test_unset_changes_nothing():
    env = {"PATH": "/bin"}
    assert caches.use_cache_dir(env) == {} and env == {"PATH": "/bin"}
