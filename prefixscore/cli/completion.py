"""`prefixscore completion bash`: a bash completion script, generated from the parsers themselves
(commands, each command's flags, a flag's choices), so it never drifts from the command line.

    source <(prefixscore completion bash)                    # this shell
    prefixscore completion bash > ~/.local/share/bash-completion/completions/prefixscore
"""
from __future__ import annotations

import argparse

from .common import COMMANDS, common_args

TEMPLATE = """# bash completion for prefixscore (prefixscore completion bash)
_prefixscore() {{
    local cur=${{COMP_WORDS[COMP_CWORD]}} prev=${{COMP_WORDS[COMP_CWORD-1]}} cmd=${{COMP_WORDS[1]}} opts
    if [ "$COMP_CWORD" -eq 1 ]; then
        COMPREPLY=($(compgen -W "{commands} --help --version" -- "$cur"))
        return
    fi
    case "$cmd" in
{commands_cases}
    esac
    if [[ "$cur" == -* ]]; then
        COMPREPLY=($(compgen -W "$opts" -- "$cur"))
    fi
}}
complete -o default -o bashdefault -F _prefixscore prefixscore
"""


def bash(parser: argparse.ArgumentParser) -> str:
    """The script for `parser` (commands.build_parser()'s, every command built): per command its
    long flags, and the choices of the flag just typed."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    cases = []
    for name, p in sub.choices.items():
        words = sorted(o for act in p._actions for o in act.option_strings if o.startswith("--"))
        choices = [f'                {o}) COMPREPLY=($(compgen -W "{" ".join(map(str, act.choices))}" '
                   f'-- "$cur")); return;;'
                   for act in p._actions if act.choices and act.option_strings for o in act.option_strings]
        cases.append(f'        {name})\n            opts="{" ".join(words)}"\n'
                     + (f'            case "$prev" in\n' + "\n".join(choices) + "\n            esac\n"
                        if choices else "") + "            ;;")
    return TEMPLATE.format(commands=" ".join(COMMANDS), commands_cases="\n".join(cases))


def add_command(sub, model_args=None) -> None:
    p = sub.add_parser("completion", help=COMMANDS["completion"][1],
                       description="Print a shell completion script for prefixscore, built from its "
                                   "own parsers: source <(prefixscore completion bash)")
    p.add_argument("shell", choices=["bash"], help="the shell (bash; zsh reads it through bashcompinit)")
    common_args(p)
    p.set_defaults(func=cmd_completion)


def cmd_completion(a) -> int:
    from .commands import build_parser

    print(bash(build_parser()), end="")
    return 0
