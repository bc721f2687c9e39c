/* Put the calling process in uninterruptible sleep (state D) for `seconds`, as a hard-mounted NFS server that
 * went away does. A vfork() parent waits for its child in TASK_KILLABLE, shown as D by the kernel (the same wait
 * NFS uses): nothing but a fatal signal wakes it. The child only sleeps and _exits, which is safe after vfork. */
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

int uninterruptible_sleep(unsigned int seconds) {
    pid_t child = vfork();
    if (child == 0) {
        sleep(seconds);
        _exit(0);
    }
    if (child < 0) return -1;
    int status;
    waitpid(child, &status, 0);
    return 0;
}
