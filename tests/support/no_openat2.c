// no_openat2 PROG [ARGS...]: runs PROG with openat2(2) failing with ENOSYS, as on kernels
// before 5.6 (RHEL 8) or under container seccomp profiles that predate it.
//
// Real kernel enforcement: PR_SET_NO_NEW_PRIVS, then a seccomp BPF filter (inherited across
// execve and fork) that answers openat2 with ENOSYS and allows every other system call. Used to
// run ckptfs and its tests against the component-walk fallback of util/path's open_beneath.
#include <errno.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

// openat2 is 437 on every architecture (syscall numbers from 424 on are shared by all of them);
// x32 sets bit 30 on its numbers.
#define NR_OPENAT2 437u
#define X32_SYSCALL_BIT 0x40000000u

#if defined(__x86_64__)
#define NATIVE_ARCH AUDIT_ARCH_X86_64
#define COMPAT_ARCH AUDIT_ARCH_I386
#elif defined(__aarch64__)
#define NATIVE_ARCH AUDIT_ARCH_AARCH64
#define COMPAT_ARCH AUDIT_ARCH_ARM
#else
#error "no_openat2: add this architecture's AUDIT_ARCH values"
#endif

#define LOAD(field) BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, field))
#define RET(value) BPF_STMT(BPF_RET | BPF_K, (value))

static int install_filter(void) {
  struct sock_filter code[] = {
      LOAD(arch),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, NATIVE_ARCH, 2, 0),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, COMPAT_ARCH, 1, 0),
      RET(SECCOMP_RET_ALLOW),  // an architecture we do not know: leave it alone
      LOAD(nr),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, NR_OPENAT2, 1, 0),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, NR_OPENAT2 | X32_SYSCALL_BIT, 0, 1),
      RET(SECCOMP_RET_ERRNO | (ENOSYS & SECCOMP_RET_DATA)),
      RET(SECCOMP_RET_ALLOW),
  };
  struct sock_fprog prog = {.len = (unsigned short)(sizeof code / sizeof code[0]), .filter = code};
  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return -1;
  return prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog);
}

int main(int argc, char** argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: no_openat2 PROG [ARGS...]\n");
    return 2;
  }
  if (install_filter() != 0) {
    fprintf(stderr, "no_openat2: cannot install the seccomp filter: %s\n", strerror(errno));
    return 126;
  }
  execvp(argv[1], argv + 1);
  fprintf(stderr, "no_openat2: %s: %s\n", argv[1], strerror(errno));
  return 127;
}
