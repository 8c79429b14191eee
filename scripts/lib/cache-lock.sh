# shellcheck shell=bash
# Cached things made once, under a lock: sourced by scripts/build-llama-server, scripts/setup-vllm and
# bench/gpu/pack. Two runs at once (two worktrees' setups, a test run beside a setup) would otherwise make one
# folder together and break each other ("Directory not empty", a file gone from under the other's pip).
# Callers run under `set -e`: a maker that fails ends the caller, its folder left without the stamp, and the
# next run wipes it and makes it again. A lock is an flock(1) on a file, released when its holder ends however
# it ends (killed included); a maker's children inherit it, so it is held while anything still writes.

# cache_lock LOCKFILE WHAT: take the exclusive lock on LOCKFILE, saying on stderr (as WHAT) while another run
# holds it. Its descriptor is left in CACHE_LOCK_FD (a function that holds one lock while it takes another
# declares it `local` first): cache_unlock releases it, and so does the caller's exit.
cache_lock() {
  local lockfile=$1 what=$2
  mkdir -p "$(dirname "$lockfile")"
  exec {CACHE_LOCK_FD}>>"$lockfile"
  if ! flock -n "$CACHE_LOCK_FD"; then
    printf '%s: waiting for another %s (it holds %s)\n' "$what" "$what" "$lockfile" >&2
    flock "$CACHE_LOCK_FD"
  fi
}

cache_unlock() {
  exec {CACHE_LOCK_FD}>&-
}

# cache_make [--in-place] DIR WHAT MAKER [ARG...]: DIR made by `MAKER ARG... FOLDER` (in a subshell, an empty
# FOLDER it fills) unless DIR/.complete says it was made already. The lock is DIR's sibling .lock-NAME, held
# from the stamp's second look (after the lock is taken: another run may have made it meanwhile) to the stamp.
# The maker fills DIR.tmp, stamped and renamed to DIR once complete; --in-place: DIR itself, for what embeds
# its own absolute path and so cannot move (a CMake build tree, a virtual environment). Whatever a killed run
# left (DIR.tmp, or DIR without its stamp) is wiped first.
cache_make() {
  local in_place=
  if [ "$1" = --in-place ]; then
    in_place=1
    shift
  fi
  local dir=$1 what=$2
  shift 2
  local CACHE_LOCK_FD
  if [ -f "$dir/.complete" ]; then
    return 0 # a stamped folder is never touched again: reused without the lock
  fi
  cache_lock "$(dirname "$dir")/.lock-$(basename "$dir")" "$what"
  if [ ! -f "$dir/.complete" ]; then
    local folder=$dir.tmp
    [ -z "$in_place" ] || folder=$dir
    rm -rf "$dir.tmp" "$dir"
    mkdir -p "$folder"
    ("$@" "$folder")
    touch "$folder/.complete"
    [ -n "$in_place" ] || mv "$folder" "$dir"
  fi
  cache_unlock
}
