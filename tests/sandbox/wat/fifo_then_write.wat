;; Create "started" in the first preopen (fd 3), then open "fifo" there for reading,
;; which blocks inside wasmtime's host code until a writer comes; then, straight-line (no
;; loop, no call: no epoch check on the way), create "late" and write "late\n" into it.
;; A guest that resumes after its job ended leaves that file behind.
(module
  (import "wasi_snapshot_preview1" "path_open"
    (func $open (param i32 i32 i32 i32 i32 i64 i64 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_write"
    (func $write (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
  (memory (export "memory") 1)
  (data (i32.const 16) "fifo")
  (data (i32.const 32) "late")
  (data (i32.const 48) "late\n")
  (data (i32.const 80) "started")
  ;; iovec at 96: (ptr 48, len 5)
  (data (i32.const 96) "\30\00\00\00\05\00\00\00")
  (func (export "_start")
    ;; oflags CREAT (1); rights FD_WRITE (64)
    (drop (call $open (i32.const 3) (i32.const 0) (i32.const 80) (i32.const 7)
      (i32.const 1) (i64.const 64) (i64.const 64) (i32.const 0) (i32.const 72)))
    (drop (call $open (i32.const 3) (i32.const 0) (i32.const 16) (i32.const 4)
      (i32.const 0) (i64.const 2) (i64.const 2) (i32.const 0) (i32.const 64)))
    (drop (call $open (i32.const 3) (i32.const 0) (i32.const 32) (i32.const 4)
      (i32.const 1) (i64.const 64) (i64.const 64) (i32.const 0) (i32.const 68)))
    (drop (call $write (i32.load (i32.const 68)) (i32.const 96) (i32.const 1) (i32.const 104)))
    (call $exit (i32.const 0))))
