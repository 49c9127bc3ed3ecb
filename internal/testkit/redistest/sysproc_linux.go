package redistest

import "syscall"

// sysProcAttr makes the kernel kill the server if the test binary dies
// without running its cleanup (a panic, a timeout, a kill).
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
