/*
 * pyacl-moe declarations for the CANN 8.x header acl/acl.h: process set-up,
 * version and the recent-error query. Needs acl_base.h first.
 */

aclError aclInit(const char *configPath);
aclError aclFinalize(void);
aclError aclrtGetVersion(int32_t *majorVersion, int32_t *minorVersion, int32_t *patchVersion);
const char *aclGetRecentErrMsg(void);
