/*
 * The release an emulated install stands for. Every other source is compiled once for all
 * releases; this file is compiled once per release profile (the builder defines
 * EMU_RELEASE_CODE, e.g. 90100 for 9.1.0, EMU_RELEASE_NAME and the ACL interface version
 * EMU_ACL_MAJOR/MINOR/PATCH) and linked into that profile's libascendcl.so. The other
 * libraries ask aclemuRelease() where releases differ (docs/emulator.md, "Releases").
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "emu.h"

#ifndef EMU_RELEASE_CODE
#error "release.c is compiled per release profile: the builder defines EMU_RELEASE_CODE"
#endif

EMU_API int aclemuRelease(void) { return EMU_RELEASE_CODE; }

EMU_API const char *aclemuReleaseName(void) { return EMU_RELEASE_NAME; }

/* The interface version each release's acl headers declare (ACL_MAJOR_VERSION and so on). */
EMU_API aclError aclrtGetVersion(int32_t *majorVersion, int32_t *minorVersion,
                                 int32_t *patchVersion) {
    EMU_ENTRY(ACL_ERROR_INTERNAL_ERROR);
    if (!majorVersion || !minorVersion || !patchVersion) {
        aclemuSetErrMsg(api, ACL_ERROR_INVALID_PARAM, "an output pointer is NULL");
        return ACL_ERROR_INVALID_PARAM;
    }
    *majorVersion = EMU_ACL_MAJOR;
    *minorVersion = EMU_ACL_MINOR;
    *patchVersion = EMU_ACL_PATCH;
    return ACL_SUCCESS;
}

#if EMU_RELEASE_CODE >= 80500
/* aclsysGetVersionStr, as the runtime of 8.5 and later has it (hicann/runtime
 * src/acl/aclrt_impl/acl.cpp, GetPkgVersionContent and aclsysGetVersionStrImpl): versionStr,
 * then pkgName, must not be NULL (100000); "driver" and "firmware" are read from the install
 * path /etc/ascend_install.info names; any other package from
 * realpath($ASCEND_HOME_PATH)/share/info/<pkgName>/version.info, retried with '-' and '_'
 * swapped; the value after the first "Version=" of a line, trimmed; a missing variable, file or
 * key, or an empty value, is 100003; a value that does not fit the 128-byte buffer 500000. It
 * needs no aclInit. */

static int version_from(const char *path, char *out, size_t cap, const char *api) {
    FILE *f = fopen(path, "r");
    if (!f) {
        aclemuSetErrMsg(api, ACL_ERROR_INVALID_FILE, "version file not found at [%s]", path);
        return ACL_ERROR_INVALID_FILE;
    }
    char line[4096];
    int found = 0, too_long = 0;
    while (fgets(line, sizeof line, f)) {
        char *at = strstr(line, "Version=");
        if (!at) continue;
        char *v = at + strlen("Version=");
        while (*v == ' ' || *v == '\t') v++;
        size_t n = strlen(v);
        while (n && (v[n - 1] == '\n' || v[n - 1] == '\r' || v[n - 1] == ' ' || v[n - 1] == '\t')) n--;
        if (n == 0) break;
        if (n >= cap) {
            too_long = 1;
        } else {
            memcpy(out, v, n);
            out[n] = 0;
            found = 1;
        }
        break;
    }
    fclose(f);
    if (too_long) {
        aclemuSetErrMsg(api, ACL_ERROR_INTERNAL_ERROR, "the version in [%s] does not fit %d bytes", path,
                        ACL_PKG_VERSION_MAX_SIZE);
        return ACL_ERROR_INTERNAL_ERROR;
    }
    if (!found) {
        aclemuSetErrMsg(api, ACL_ERROR_INVALID_FILE, "[%s]: keyword Version= not found in version info file",
                        path);
        return ACL_ERROR_INVALID_FILE;
    }
    return ACL_SUCCESS;
}

/* The value of key in /etc/ascend_install.info (the driver's install record). */
static int install_param(const char *key, char *out, size_t cap) {
    FILE *f = fopen("/etc/ascend_install.info", "r");
    if (!f) return -1;
    char line[4096];
    int ok = -1;
    while (fgets(line, sizeof line, f)) {
        char *at = strstr(line, key);
        if (!at) continue;
        char *v = at + strlen(key);
        size_t n = strcspn(v, "\r\n");
        if (n && n < cap) {
            memcpy(out, v, n);
            out[n] = 0;
            ok = 0;
        }
        break;
    }
    fclose(f);
    return ok;
}

static int version_of(const char *pkg, char *out, const char *api) {
    char path[PATH_MAX + 256];
    if (!strcmp(pkg, "driver") || !strcmp(pkg, "firmware")) {
        char root[PATH_MAX];
        const char *key = !strcmp(pkg, "driver") ? "Driver_Install_Path_Param=" : "Firmware_Install_Path_Param=";
        if (install_param(key, root, sizeof root)) {
            aclemuSetErrMsg(api, ACL_ERROR_INVALID_FILE, "no %s in /etc/ascend_install.info", key);
            return ACL_ERROR_INVALID_FILE;
        }
        snprintf(path, sizeof path, "%s/%s/version.info", root, pkg);
    } else {
        const char *env = getenv("ASCEND_HOME_PATH");
        char home[PATH_MAX];
        if (!env || !realpath(env, home)) {
            aclemuSetErrMsg(api, ACL_ERROR_INVALID_FILE, "ASCEND_HOME_PATH is %s", env ? "not a folder" : "unset");
            return ACL_ERROR_INVALID_FILE;
        }
        snprintf(path, sizeof path, "%s/share/info/%s/version.info", home, pkg);
    }
    return version_from(path, out, ACL_PKG_VERSION_MAX_SIZE, api);
}

EMU_API aclError aclsysGetVersionStr(char *pkgName, char *versionStr) {
    EMU_ENTRY(ACL_ERROR_INTERNAL_ERROR);
    if (!versionStr || !pkgName) {
        aclemuSetErrMsg(api, ACL_ERROR_INVALID_PARAM, "%s is NULL", !versionStr ? "versionStr" : "pkgName");
        return ACL_ERROR_INVALID_PARAM;
    }
    int st = version_of(pkgName, versionStr, api);
    if (!st) return ACL_SUCCESS;
    char alt[256];
    size_t n = strlen(pkgName);
    if (n >= sizeof alt) return st;
    memcpy(alt, pkgName, n + 1);
    char from = strchr(alt, '-') ? '-' : strchr(alt, '_') ? '_' : 0;
    if (!from) return st;
    for (char *c = alt; *c; c++)
        if (*c == from) *c = from == '-' ? '_' : '-';
    return version_of(alt, versionStr, api);
}
#endif
