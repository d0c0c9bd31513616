/* Preloaded into the emulator's process (emulator.py), for two things the bochscpu-python wheel
 * does not offer:
 * - its binary calls glibc 2.38's C23 names of strtoull and sscanf; older glibcs (Debian 12 has
 *   2.36) have the same functions under their plain names;
 * - it builds one CPU model, a Skylake-X (AVX-512 F/BW/VL, no VNNI, no BF16). Bochs picks the
 *   model by its index in cpudb.h when the "model" parameter is made, so this wraps that
 *   parameter's constructor and hands it the index in EMU_CPU_INDEX (Sapphire Rapids: VNNI and
 *   BF16, the AVX-512 ISA of a Zen 4 and more). EMU_BOCHS_SO names the wheel's library, whose own
 *   constructor this calls (it is loaded RTLD_LOCAL, out of reach of RTLD_NEXT). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

unsigned long long __isoc23_strtoull(const char *s, char **end, int base) { return strtoull(s, end, base); }
long __isoc23_strtol(const char *s, char **end, int base) { return strtol(s, end, base); }
int __isoc23_sscanf(const char *s, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    const int n = vsscanf(s, fmt, ap);
    va_end(ap);
    return n;
}

#define ENUM_CTOR "_ZN15bx_param_enum_cC1EP10bx_param_cPKcS3_S3_PS3_ll"
typedef void (*enum_ctor)(void *, void *, const char *, const char *, const char *, const char **,
                          long, long);
static const char *any_model[64];

void _ZN15bx_param_enum_cC1EP10bx_param_cPKcS3_S3_PS3_ll(void *self, void *parent, const char *name,
        const char *label, const char *desc, const char **choices, long initial, long base) {
    const char *index = getenv("EMU_CPU_INDEX");
    if (name && index && !strcmp(name, "model")) {
        /* The enum checks the index against its list: give it a list long enough. */
        for (int i = 0; i < 63; i++) any_model[i] = "model";
        choices = any_model;
        initial = atol(index);
    }
    void *lib = dlopen(getenv("EMU_BOCHS_SO"), RTLD_NOLOAD | RTLD_LAZY);
    enum_ctor real = lib ? (enum_ctor)dlsym(lib, ENUM_CTOR) : NULL;
    if (!real) {
        fprintf(stderr, "glibc_shim: %s not found in %s\n", ENUM_CTOR, getenv("EMU_BOCHS_SO"));
        abort();
    }
    real(self, parent, name, label, desc, choices, initial, base);
}
