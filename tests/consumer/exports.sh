#!/usr/bin/env bash
# libloom exports its public API only (docs/architecture.md, "What the library exports"): every
# defined dynamic symbol must be Loom's public code (namespace loom; not loom::util,
# loom::internal, an anonymous namespace or a class's private Impl), its vtables and type
# information, or the ELF markers every shared library has: none of the third-party code
# compiled into it (std:: instantiations, torch's, gRPC's). Prints each symbol that is not, and fails. Run by ctest
# (test "library.exports_public_api_only") with the path of libloom.so.
set -euo pipefail
lib=$1
[[ -f $lib ]] || { echo "exports.sh: no library at $lib" >&2; exit 2; }
symbols=$(nm -D --defined-only "$lib" | awk '{ print $3 }' | c++filt)
total=$(wc -l <<< "$symbols")
[[ $total -gt 100 ]] || { echo "exports.sh: only $total symbols in $lib: is it Loom?" >&2; exit 1; }
# Strip what may precede the name (vtable for, typeinfo for, a return type), then keep what is
# not loom:: code, or is private loom code.
bad=$(sed -E 's/^(vtable for |typeinfo for |typeinfo name for |VTT for |construction vtable for [^ ]+-in-|guard variable for |non-virtual thunk to |virtual thunk to )+//' <<< "$symbols" |
  grep -vE '^(_init|_fini|_edata|_end|__bss_start)$' |
  grep -vE '^loom::| loom::Config::get<' || true)
bad+=$'\n'$(grep -E 'loom::(util|internal)::|\(anonymous namespace\)|::(Impl|Job)(::|$)' <<< "$symbols" || true)
bad=$(sed '/^$/d' <<< "$bad" | sort -u)
if [[ -n $bad ]]; then
  echo "exports.sh: $lib exports $(wc -l <<< "$bad") symbol(s) outside Loom's public API:"
  head -50 <<< "$bad"
  echo "exports.sh: mark public API with LOOM_API (loom/visibility.h); keep the rest hidden" >&2
  exit 1
fi
echo "exports.sh: $total symbols, each Loom's public API"
