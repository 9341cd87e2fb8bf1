;; Reference assertion (c) and the timeout tests: loop forever, burning fuel.
(module
  (memory (export "memory") 1)
  (func (export "_start") (local $i i32)
    (loop $again
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br $again))))
