# Sourced (from the repo root) by bench/fetch_*_wheels.sh and bench/make_device_dir.sh: sets PIP to the project's
# venv's pip, found relative to this checkout -- ./.venv/bin/pip, else the main checkout's when this one is a git
# worktree (the folder above `git rev-parse --git-common-dir`). PIP=/path/to/pip overrides; exits in one line when
# none is found.
if [ -z "${PIP:-}" ]; then
  for _root in "$PWD" "$(dirname "$(git rev-parse --path-format=absolute --git-common-dir 2>/dev/null || echo .)")"; do
    [ -x "$_root/.venv/bin/pip" ] && { PIP=$_root/.venv/bin/pip; break; }
  done
  unset _root
  [ -n "${PIP:-}" ] || { echo "no .venv/bin/pip here ($PWD) nor in the main checkout: set PIP=/path/to/pip" >&2; exit 2; }
fi
