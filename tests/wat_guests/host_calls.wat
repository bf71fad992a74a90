(component
  (type $ty-pie:inferlet/types@0.1.0 (;0;)
    (instance
      (type (;0;) u32)
      (export (;1;) "model" (type (eq 0)))
      (type (;2;) u32)
      (export (;3;) "context" (type (eq 2)))
      (type (;4;) (record (field "kind" string) (field "message" string)))
      (export (;5;) "error" (type (eq 4)))
      (type (;6;) u32)
      (export (;7;) "pollable" (type (eq 6)))
    )
  )
  (import "pie:inferlet/types@0.1.0" (instance $pie:inferlet/types@0.1.0 (;0;) (type $ty-pie:inferlet/types@0.1.0)))
  (alias export $pie:inferlet/types@0.1.0 "model" (type $model (;1;)))
  (alias export $pie:inferlet/types@0.1.0 "context" (type $context (;2;)))
  (alias export $pie:inferlet/types@0.1.0 "error" (type $error (;3;)))
  (type $ty-pie:inferlet/context@0.1.0 (;4;)
    (instance
      (alias outer 1 $model (type (;0;)))
      (export (;1;) "model" (type (eq 0)))
      (alias outer 1 $context (type (;2;)))
      (export (;3;) "context" (type (eq 2)))
      (alias outer 1 $error (type (;4;)))
      (export (;5;) "error" (type (eq 4)))
      (type (;6;) (result 3 (error 5)))
      (type (;7;) (func (param "model" 1) (result 6)))
      (export (;0;) "create" (func (type 7)))
    )
  )
  (import "pie:inferlet/context@0.1.0" (instance $pie:inferlet/context@0.1.0 (;1;) (type $ty-pie:inferlet/context@0.1.0)))
  (alias export $pie:inferlet/types@0.1.0 "pollable" (type $pollable (;5;)))
  (alias export $pie:inferlet/types@0.1.0 "error" (type $"#type6 error" (@name "error") (;6;)))
  (type $ty-pie:inferlet/futures@0.1.0 (;7;)
    (instance
      (alias outer 1 $pollable (type (;0;)))
      (export (;1;) "pollable" (type (eq 0)))
      (alias outer 1 $"#type6 error" (type (;2;)))
      (export (;3;) "error" (type (eq 2)))
      (type (;4;) (list 1))
      (type (;5;) (list u32))
      (type (;6;) (result 5 (error 3)))
      (type (;7;) (func (param "pending" 4) (result 6)))
      (export (;0;) "poll" (func (type 7)))
    )
  )
  (import "pie:inferlet/futures@0.1.0" (instance $pie:inferlet/futures@0.1.0 (;2;) (type $ty-pie:inferlet/futures@0.1.0)))
  (alias export $pie:inferlet/types@0.1.0 "pollable" (type $"#type8 pollable" (@name "pollable") (;8;)))
  (type $ty-pie:inferlet/session@0.1.0 (;9;)
    (instance
      (alias outer 1 $"#type8 pollable" (type (;0;)))
      (export (;1;) "pollable" (type (eq 0)))
      (type (;2;) (func (result 1)))
      (export (;0;) "receive" (func (type 2)))
    )
  )
  (import "pie:inferlet/session@0.1.0" (instance $pie:inferlet/session@0.1.0 (;3;) (type $ty-pie:inferlet/session@0.1.0)))
  (core module $main (;0;)
    (type (;0;) (func (param i32 i32)))
    (type (;1;) (func (result i32)))
    (type (;2;) (func (param i32 i32 i32)))
    (type (;3;) (func (param i32 i32 i32 i32) (result i32)))
    (type (;4;) (func (param i32 i32 i32) (result i32)))
    (type (;5;) (func (param i32 i32) (result i32)))
    (import "pie:inferlet/context@0.1.0" "create" (func $context_create (;0;) (type 0) (param i32 i32)))
    (import "pie:inferlet/session@0.1.0" "receive" (func $session_receive (;1;) (type 1) (result i32)))
    (import "pie:inferlet/futures@0.1.0" "poll" (func $futures_poll (;2;) (type 2) (param i32 i32 i32)))
    (memory (;0;) 2)
    (global $heap (;0;) (mut i32) i32.const 4096)
    (export "memory" (memory 0))
    (export "cabi_realloc" (func 3))
    (export "run" (func 5))
    (func (;3;) (type 3) (param i32 i32 i32 i32) (result i32)
      (local $p i32)
      global.get $heap
      local.get 2
      i32.const 1
      i32.sub
      i32.add
      i32.const 0
      local.get 2
      i32.sub
      i32.and
      local.set $p
      local.get $p
      local.get 3
      i32.add
      global.set $heap
      local.get $p
    )
    (func $answer (;4;) (type 4) (param $tag i32) (param $ptr i32) (param $len i32) (result i32)
      i32.const 32
      local.get $tag
      i32.store8
      i32.const 36
      local.get $ptr
      i32.store
      i32.const 40
      local.get $len
      i32.store
      i32.const 32
    )
    (func (;5;) (type 5) (param $ptr i32) (param $len i32) (result i32)
      (local $c i32)
      local.get $len
      i32.eqz
      if ;; label = @1
        i32.const 1
        i32.const 16
        i32.const 0
        call $answer
        return
      end
      local.get $ptr
      i32.load8_u
      local.set $c
      local.get $c
      i32.const 111
      i32.eq
      if ;; label = @1
        i32.const 0
        i32.const 16
        i32.const 4
        call $answer
        return
      end
      local.get $c
      i32.const 101
      i32.eq
      if ;; label = @1
        i32.const 0
        local.get $ptr
        local.get $len
        call $answer
        return
      end
      local.get $c
      i32.const 116
      i32.eq
      if ;; label = @1
        unreachable
      end
      local.get $c
      i32.const 108
      i32.eq
      if ;; label = @1
        loop $forever
          br $forever
        end
      end
      local.get $c
      i32.const 99
      i32.eq
      if ;; label = @1
        i32.const 1
        i32.const 64
        call $context_create
        i32.const 1
        i32.const 64
        call $context_create
        unreachable
      end
      local.get $c
      i32.const 112
      i32.eq
      if ;; label = @1
        i32.const 128
        call $session_receive
        i32.store
        i32.const 128
        i32.const 1
        i32.const 64
        call $futures_poll
        i32.const 0
        i32.const 16
        i32.const 4
        call $answer
        return
      end
      i32.const 1
      local.get $ptr
      local.get $len
      call $answer
    )
    (data (;0;) (i32.const 16) "fine")
    (@producers
      (processed-by "wit-component" "0.262.0")
    )
  )
  (core module $wit-component-shim-module (;1;)
    (type (;0;) (func (param i32 i32)))
    (type (;1;) (func (param i32 i32 i32)))
    (table (;0;) 2 2 funcref)
    (export "0" (func $indirect-pie:inferlet/context@0.1.0-create))
    (export "1" (func $indirect-pie:inferlet/futures@0.1.0-poll))
    (export "$imports" (table 0))
    (func $indirect-pie:inferlet/context@0.1.0-create (;0;) (type 0) (param i32 i32)
      local.get 0
      local.get 1
      i32.const 0
      call_indirect (type 0)
    )
    (func $indirect-pie:inferlet/futures@0.1.0-poll (;1;) (type 1) (param i32 i32 i32)
      local.get 0
      local.get 1
      local.get 2
      i32.const 1
      call_indirect (type 1)
    )
    (@producers
      (processed-by "wit-component" "0.262.0")
    )
  )
  (core instance $wit-component-shim-instance (;0;) (instantiate $wit-component-shim-module))
  (alias core export $wit-component-shim-instance "0" (core func $indirect-pie:inferlet/context@0.1.0-create (;0;)))
  (core instance $pie:inferlet/context@0.1.0 (;1;)
    (export "create" (func $indirect-pie:inferlet/context@0.1.0-create))
  )
  (alias export $pie:inferlet/session@0.1.0 "receive" (func $receive (;0;)))
  (core func $receive (;1;) (canon lower (func $receive)))
  (core instance $pie:inferlet/session@0.1.0 (;2;)
    (export "receive" (func $receive))
  )
  (alias core export $wit-component-shim-instance "1" (core func $indirect-pie:inferlet/futures@0.1.0-poll (;2;)))
  (core instance $pie:inferlet/futures@0.1.0 (;3;)
    (export "poll" (func $indirect-pie:inferlet/futures@0.1.0-poll))
  )
  (core instance $main (;4;) (instantiate $main
      (with "pie:inferlet/context@0.1.0" (instance $pie:inferlet/context@0.1.0))
      (with "pie:inferlet/session@0.1.0" (instance $pie:inferlet/session@0.1.0))
      (with "pie:inferlet/futures@0.1.0" (instance $pie:inferlet/futures@0.1.0))
    )
  )
  (alias core export $main "memory" (core memory $memory (;0;)))
  (core module $wit-component-fixup (;2;)
    (type (;0;) (func (param i32 i32)))
    (type (;1;) (func (param i32 i32 i32)))
    (import "actual" "0" (func $0 (;0;) (type 0) (param i32 i32)))
    (import "actual" "1" (func $1 (;1;) (type 1) (param i32 i32 i32)))
    (import "shim" "$imports" (table (;0;) 2 2 funcref))
    (elem (;0;) (i32.const 0) func $0 $1)
    (@producers
      (processed-by "wit-component" "0.262.0")
    )
  )
  (alias export $pie:inferlet/context@0.1.0 "create" (func $create (;1;)))
  (alias core export $main "cabi_realloc" (core func $cabi_realloc (;3;)))
  (core func $"#core-func4 indirect-pie:inferlet/context@0.1.0-create" (@name "indirect-pie:inferlet/context@0.1.0-create") (;4;) (canon lower (func $create) (memory $memory) (realloc $cabi_realloc) string-encoding=utf8))
  (alias export $pie:inferlet/futures@0.1.0 "poll" (func $poll (;2;)))
  (core func $"#core-func5 indirect-pie:inferlet/futures@0.1.0-poll" (@name "indirect-pie:inferlet/futures@0.1.0-poll") (;5;) (canon lower (func $poll) (memory $memory) (realloc $cabi_realloc) string-encoding=utf8))
  (core instance $actual (;5;)
    (export "0" (func $"#core-func4 indirect-pie:inferlet/context@0.1.0-create"))
    (export "1" (func $"#core-func5 indirect-pie:inferlet/futures@0.1.0-poll"))
  )
  (core instance $fixup (;6;) (instantiate $wit-component-fixup
      (with "actual" (instance $actual))
      (with "shim" (instance $wit-component-shim-instance))
    )
  )
  (type (;10;) (result string (error string)))
  (type (;11;) (func (param "input" string) (result 10)))
  (alias core export $main "run" (core func $run (;6;)))
  (func $run (;3;) (type 11) (canon lift (core func $run) (memory $memory) (realloc $cabi_realloc) string-encoding=utf8))
  (export $"#func4 run" (@name "run") (;4;) "run" (func $run))
  (@producers
    (processed-by "wit-component" "0.262.0")
  )
)
