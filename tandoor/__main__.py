"""`python -m tandoor`: the same as the `tandoor` command."""

from tandoor.cli import main

if __name__ == "__main__":  # vLLM's spawned engine core re-imports this module
    main()
