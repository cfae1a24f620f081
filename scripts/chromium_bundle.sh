#!/usr/bin/env bash
# Packs Debian's chromium-headless-shell, with the shared libraries it links against, into one
# relocatable archive, for `voice-out bench --mode webrtc --client chromium` on a machine that
# has no Chromium and cannot install one (a GPU server without a package registry, say).
#
#   apt-get install chromium-headless-shell   # on a Debian machine of the same architecture
#   bash scripts/chromium_bundle.sh chromium.tar.xz
#   # on the target: tar -xJf chromium.tar.xz -C /opt
#   voice-out bench --mode webrtc --client chromium --chromium /opt/chromium/run.sh ...
#
# XZ_LEVEL=-1 packs faster and larger (the default -9 takes minutes: the browser is ~200 MB).
# glibc itself stays out (the target's is used: it must be at least as new as the build
# machine's); everything else comes along, NSS's loadable modules and one font included. run.sh
# puts the libraries on LD_LIBRARY_PATH, and the font's fontconfig file in FONTCONFIG_FILE, for
# the browser's processes alone.
set -euo pipefail
out=${1:?usage: chromium_bundle.sh OUT.tar.xz}
src=/usr/lib/chromium
libdir=/usr/lib/$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)
[ -x "$src/chromium-headless-shell" ] || { echo "no $src/chromium-headless-shell: apt-get install chromium-headless-shell" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
dest=$work/chromium
mkdir -p "$dest/lib"
cp "$src/chromium-headless-shell" "$src"/headless_*.pak "$dest/"
for f in icudtl.dat v8_context_snapshot.bin snapshot_blob.bin; do
  [ -e "$src/$f" ] && cp "$src/$f" "$dest/"
done
ldd "$src/chromium-headless-shell" | awk '/=>/ {print $3}' |
  grep -v -E '/(libc|libm|libdl|libpthread|librt|libresolv|ld-linux[^/]*)\.so' |
  while read -r lib; do cp -L "$lib" "$dest/lib/"; done
# NSS loads these at run time (no ldd entry): certificates, its soft token, its crypto.
for f in libsoftokn3.so libfreebl3.so libfreeblpriv3.so libnssckbi.so libnssdbm3.so; do
  [ -e "$libdir/$f" ] && cp -L "$libdir/$f" "$dest/lib/"
done
# One font and a fontconfig file that names it: with no font at all, the headless shell aborts
# as soon as a page draws text (a GPU server's image often has none).
font=$(fc-match -f '%{file}' 'DejaVu Sans' 2>/dev/null || true)
[ -n "$font" ] && [ -e "$font" ] || font=$(find /usr/share/fonts -name '*.ttf' | head -n 1)
[ -n "$font" ] || { echo "no TrueType font found: apt-get install fonts-dejavu-core" >&2; exit 1; }
mkdir -p "$dest/fonts"
cp -L "$font" "$dest/fonts/"
cat >"$dest/fonts.conf" <<'EOF'
<?xml version="1.0"?>
<!DOCTYPE fontconfig SYSTEM "urn:fontconfig:fonts.dtd">
<fontconfig>
  <dir prefix="relative">fonts</dir>
  <cachedir prefix="xdg">voice_out-chromium-fontconfig</cachedir>
</fontconfig>
EOF
cat >"$dest/run.sh" <<'EOF'
#!/bin/sh
# Headless Chromium from this folder, with the libraries it was built against and its font.
here=$(dirname "$(readlink -f "$0")")
export FONTCONFIG_FILE="${FONTCONFIG_FILE:-$here/fonts.conf}"
LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/chromium-headless-shell" "$@"
EOF
chmod +x "$dest/run.sh"
tar -C "$work" -cf - chromium | xz "${XZ_LEVEL:--9}" -T0 >"$out"
echo "$out: $(du -h "$out" | cut -f1) ($("$dest/run.sh" --version 2>/dev/null || echo 'version unknown'))"
